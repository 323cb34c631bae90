"""Parsing of user input: SLO strings, length distributions, settings from LOADGEN_* variables."""

from __future__ import annotations

import random

import pytest

from loadgen.lengths import parse_dist
from loadgen.settings import Settings
from loadgen.slo import SLO, parse_slo


def test_parse_slo_ok():
    assert parse_slo("ttft=500,tpot=50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo(" TTFT=2s , e2el=1500ms ") == SLO(ttft_ms=2000, e2e_ms=1500)
    assert parse_slo(None).is_empty and parse_slo("").is_empty
    assert str(parse_slo("ttft=500,tpot=50")) == "ttft=500ms,tpot=50ms"


@pytest.mark.parametrize("spec, fragment", [
    ("ttft=abc", "ttft='abc' is not a number of milliseconds"),
    ("ttft", "'ttft' is not KEY=MS"),
    ("ttft=", "is not KEY=MS"),
    ("latency=5", "unknown metric 'latency'"),
    ("ttft=-3", "must be a positive number"),
    ("ttft=0", "must be a positive number"),
    ("ttft=nan", "must be a positive number"),
    ("ttft=1,ttft=2", "ttft given twice"),
])
def test_parse_slo_errors_name_the_bad_part(spec, fragment):
    with pytest.raises(ValueError) as err:
        parse_slo(spec)
    assert fragment in str(err.value) and repr(spec) in str(err.value)


def test_slo_is_met_counts_single_token_tpot_as_zero():
    slo = SLO(ttft_ms=100, tpot_ms=10)
    assert slo.is_met(0.1, None, 5.0)
    assert not slo.is_met(0.1001, None, 5.0)
    assert not slo.is_met(0.05, 0.011, 5.0)
    assert SLO(e2e_ms=1000).is_met(9.0, 9.0, 1.0)


def test_dists_sample_in_range_and_reproducibly():
    rng_a, rng_b = random.Random(1), random.Random(1)
    for spec in ("512", "uniform:10,20", "normal:100,10", "lognormal:64,0.5", "exp:0.5"):
        d = parse_dist(spec)
        a = [d.sample(rng_a) for _ in range(200)]
        assert a == [d.sample(rng_b) for _ in range(200)]
        assert str(parse_dist(str(d))) == str(d)
    u = parse_dist("uniform:10,20")
    assert all(10 <= u.sample_int(random.Random(k)) <= 20 for k in range(100))
    assert parse_dist("normal:0,5").sample_int(random.Random(0), minimum=1) >= 1
    assert parse_dist("exp:100").sample_float(random.Random(0), cap=0.5) <= 0.5


@pytest.mark.parametrize("spec, fragment", [
    ("zipf:1", "unknown distribution 'zipf'"), ("uniform:1", "uniform needs 2"),
    ("uniform:5,1", "LO <= HI"), ("abc", "not a number"), ("normal:1,-1", ">= 0"),
    ("lognormal:0,1", "median must be > 0"),
])
def test_dist_errors(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_dist(spec, "--output-len")


def test_settings_env_prefix(monkeypatch):
    monkeypatch.setenv("LOADGEN_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LOADGEN_DRAIN_S", "3.5")
    s = Settings()
    assert s.url == "http://127.0.0.1:9" and s.drain_s == 3.5 and s.endpoint == "chat"
