"""Node facts parsing, health thresholds, circuit breakers, sessions, config loading and the CLI."""

from __future__ import annotations

import pytest

from router.breaker import CircuitBreaker
from router.cli import main as cli_main
from router.config import InstanceSpec, load_config
from router.facts import parse_metrics, parse_models
from router.health import apply_probe
from router.placement import SessionRecord
from router.registry import InstanceState
from router.sessions import SessionTable

VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="4096"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""
REFERENCE_METRICS = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="2048",cache_dtype="fp8",num_gpu_blocks="10",layout_fingerprint="abc",tp_size="8",dcp_size="8",engine="reference"} 1.0
"""


def test_parse_vllm_metrics():
    cache, load = parse_metrics(VLLM_METRICS)
    assert (cache.block_size, cache.cache_dtype, cache.num_gpu_blocks, cache.engine) == (128, "auto", 4096, None)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (2.0, 1.0, 0.25)


def test_parse_reference_metrics():
    cache, _ = parse_metrics(REFERENCE_METRICS)
    assert (cache.block_size, cache.layout_fingerprint, cache.tp_size, cache.dcp_size, cache.engine) == \
        (2048, "abc", 8, 8, "reference")


def test_parse_models():
    facts = parse_models({"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 1024}, {}]})
    assert facts.model_ids == ("a", "b") and facts.max_model_len == 1024


def test_parse_models_weights_identity():
    ref = parse_models({"data": [{"id": "m", "root": "m", "weights_fingerprint": "abc"}]})
    vllm = parse_models({"data": [{"id": "served", "root": "/models/kimi", "parent": None}]})
    assert (ref.weights_fingerprint, ref.root) == ("abc", "m")
    assert (vllm.weights_fingerprint, vllm.root) == (None, "/models/kimi")


@pytest.mark.parametrize("probes,unhealthy_at,healthy_at,expected", [
    ("+", 2, 1, True), ("++", 2, 2, True), ("+", 2, 2, False), ("++-", 2, 1, True), ("++--", 2, 1, False),
    ("++--+", 2, 1, True), ("+-+-+-", 2, 1, True), ("+---", 3, 1, False),
], ids=["one-up", "two-up", "needs-two", "one-blip", "two-down", "recovers", "flapping", "three-down"])
def test_health_thresholds(probes, unhealthy_at, healthy_at, expected):
    state = InstanceState(spec=InstanceSpec(name="x", role="decode", url="http://x:1"))
    for probe in probes:
        apply_probe(state, probe == "+", unhealthy_at, healthy_at)
    assert state.is_healthy is expected


def test_circuit_breaker_cycle():
    b = CircuitBreaker(failure_threshold=2, recovery_s=10.0)
    b.attempt(0.0).failed(0.0)
    assert b.allows(1.0)
    b.attempt(1.0).failed(1.0)
    assert b.state(2.0) == "open" and not b.allows(2.0)
    assert b.state(11.0) == "half_open" and b.allows(11.0)
    trial = b.attempt(11.0)
    assert not b.allows(11.5), "one trial at a time while half-open"
    trial.failed(12.0)
    assert b.state(13.0) == "open"
    b.attempt(22.0).succeeded()
    assert b.state(22.0) == "closed" and b.allows(22.0)


def test_session_table_ttl_and_bound():
    table = SessionTable(ttl_s=10.0, max_sessions=2)
    for i, t in enumerate((0.0, 1.0, 2.0)):
        table.put(SessionRecord(f"s{i}", "p", "d", 10, t))
    assert table.get("s0", 3.0) is None and table.get("s1", 3.0) is not None
    assert table.get("s1", 20.0) is None
    assert table.count_by_pool(5.0) == {"p": 1}


def test_load_config(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("""
pools:
  - {name: tp, kind: tp, max_context_tokens: 1000}
  - {name: long, kind: dcp}
instances:
  - {name: p0, role: prefill, url: "http://p0:8000/", tp: 4, engine: vllm}
  - {name: d0, role: decode, url: "http://d0:8000", pool: long, tp: 8, dcp: 8, block_size: 16}
kubernetes: {namespace: serving}
router: {admin_token: t, prefill_timeout_s: 3}
""")
    config = load_config(path)
    assert [p.kind for p in config.pools] == ["tp", "dcp"]
    assert config.instances[0].url == "http://p0:8000" and config.instances[1].dcp == 8
    assert config.kubernetes.namespace == "serving" and config.router["prefill_timeout_s"] == 3


@pytest.mark.parametrize("text,fragment", [
    ("instances: [{name: a, role: decode, url: 'ftp://x'}]", "http"),
    ("instances: [{name: a, role: boss, url: 'http://x'}]", "role"),
    ("instances: [{name: a, role: decode, url: 'http://x'}, {name: a, role: decode, url: 'http://y'}]",
     "duplicate"),
    ("pools: [{name: a, kind: ring}]", "kind"),
], ids=["bad-url", "bad-role", "duplicate-name", "bad-pool-kind"])
def test_bad_config_is_refused(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        load_config(path)


def test_cli_needs_a_source(capsys):
    assert cli_main([]) == 2
    assert "--config" in capsys.readouterr().out
