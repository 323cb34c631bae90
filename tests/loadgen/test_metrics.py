"""Metric math against hand-computed cases and against the installed vLLM's own `calculate_metrics` (run in the
vLLM venv by tests/loadgen/vllm_metrics.py)."""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadgen.client import has_output
from loadgen.metrics import (
    naive_percentile, pareto_points, percentile, request_timing, summarize_level, throughput_timeline,
)
from loadgen.slo import SLO
from tests.loadgen.helpers import record
from tests.vllm_fixtures import cached_answer, vllm_install, vllm_python

VLLM_METRICS = Path(__file__).with_name("vllm_metrics.py")
SEEDS = range(3)
SLO_MS = {"ttft": 1200, "tpot": 35, "e2el": 2500}
DURATION_S = 7.5


def test_timing_multi_token():
    t = request_timing(1.0, [1.5, 1.7, 2.0, 2.1], 4)
    assert t.ttft_s == pytest.approx(0.5)
    assert t.e2e_s == pytest.approx(1.1)
    assert t.itl_s == pytest.approx((0.2, 0.3, 0.1))
    assert t.tpot_s == pytest.approx((1.1 - 0.5) / 3)


def test_timing_uses_token_count_not_chunks():
    # 5 tokens in 2 chunks (bundled): TPOT divides by n - 1 = 4, ITL has one gap
    t = request_timing(1.0, [1.5, 2.0], 5)
    assert t.tpot_s == pytest.approx(0.125)
    assert t.itl_s == pytest.approx((0.5,))


def test_timing_single_token_has_no_tpot():
    t = request_timing(0.0, [0.3], 1)
    assert t.ttft_s == pytest.approx(0.3) and t.e2e_s == pytest.approx(0.3)
    assert t.tpot_s is None and t.itl_s == ()
    assert request_timing(0.0, [], 0) is None


def _mixed_records():
    return [
        record("a", [0.5, 0.7, 1.0, 1.1], n=4),                       # ttft 500, tpot 200
        record("b", [0.3], n=1),                                      # ttft 300, no tpot
        record("c", [], outcome="error", kind="http_500"),
        record("d", [0.2, 0.25], outcome="cancelled", kind="cancelled"),
        record("e", [0.4], outcome="error", kind="disconnect"),
    ]


def test_summary_hand_computed():
    lv = summarize_level(4, _mixed_records(), 2.0, SLO(ttft_ms=400, tpot_ms=100), gpus=5, split=(2, 3))
    assert (lv.num_requests, lv.num_ok, lv.num_errors, lv.num_cancelled) == (5, 2, 2, 1)
    assert lv.errors_by_kind == {"cancelled": 1, "disconnect": 1, "http_500": 1}
    assert lv.output_tokens == 5 and lv.input_tokens == 20
    assert lv.output_tok_s == pytest.approx(2.5)
    assert lv.total_tok_s_per_gpu == pytest.approx(25 / 2.0 / 5)
    assert lv.input_tok_s_per_prefill_gpu == pytest.approx(20 / 2.0 / 2)
    assert lv.output_tok_s_per_decode_gpu == pytest.approx(5 / 2.0 / 3)
    assert lv.request_throughput == pytest.approx(1.0)
    # TTFT over ok requests only: [300, 500] ms
    assert lv.ttft_ms.count == 2 and lv.ttft_ms.p50 == pytest.approx(400) and lv.ttft_ms.p90 == pytest.approx(480)
    # TPOT: the n = 1 request is left out
    assert lv.tpot_ms.count == 1 and lv.tpot_ms.p50 == pytest.approx(200)
    # ITL pooled from ok requests only (the cancelled stream's gap is not in it)
    assert lv.itl_ms.count == 3 and lv.itl_ms.p50 == pytest.approx(200)
    assert lv.e2e_ms.max == pytest.approx(1100)
    assert lv.per_user_tok_s.p50 == pytest.approx(5.0)
    # goodput: "a" misses TTFT 400; "b" passes (n = 1 counts as TPOT 0); errors/cancelled never good
    assert lv.goodput_req_s == pytest.approx(0.5)
    assert lv.slo_attainment == pytest.approx(1 / 5)


def test_summary_without_slo_or_gpus():
    lv = summarize_level(1, _mixed_records(), 2.0, SLO())
    assert lv.goodput_req_s is None and lv.total_tok_s_per_gpu is None and lv.output_tok_s_per_decode_gpu is None


def test_all_failed_level_is_empty_not_crashing():
    lv = summarize_level(1, [record("c", [], outcome="error", kind="connect")], 1.0, SLO(ttft_ms=1))
    assert lv.num_ok == 0 and lv.ttft_ms.count == 0 and lv.ttft_ms.p50 is None
    assert lv.goodput_req_s == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_percentile_matches_naive(seed):
    rng = random.Random(seed)
    values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 300))]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(naive_percentile(values, q), rel=1e-12, abs=1e-15)


def test_pareto_frontier():
    lvs = [summarize_level(c, [record(f"r{c}", [0.1, 0.2])], 1.0, SLO(), gpus=1) for c in (1, 4, 16, 32)]
    for lv, (x, y) in zip(lvs, ((50.0, 10.0), (30.0, 40.0), (20.0, 30.0), (10.0, 40.0))):
        lv.per_user_tok_s.p50, lv.total_tok_s_per_gpu = x, y
    points = pareto_points(lvs)
    assert [(p.per_user_tok_s, p.tok_s_per_gpu) for p in points] == [(50, 10), (30, 40), (20, 30), (10, 40)]
    # (20, 30) is beaten by (30, 40) on both axes; (10, 40) ties on y but is slower per user
    assert [p.on_frontier for p in points] == [True, True, False, False]


def test_throughput_timeline_counts_all_tokens():
    recs = [record("a", [0.1, 0.6, 1.2], n=6), record("b", [1.9], n=1)]
    starts, rates = throughput_timeline(recs, bin_s=1.0)
    assert starts == [0.0, 1.0]
    assert rates == pytest.approx([4.0, 3.0])
    assert sum(rates) == pytest.approx(7.0)


def _random_records(seed: int):
    rng = random.Random(seed)
    recs = []
    for i in range(200):
        kind = rng.random()
        if kind < 0.1:
            recs.append(record(f"e{i}", [], outcome="error", kind="http_503"))
            continue
        start = rng.uniform(0, 5)
        n = 1 if kind < 0.2 else rng.randint(2, 40)
        num_chunks = n if rng.random() < 0.7 else max(1, n // 3)
        t = start + rng.uniform(0.05, 2.0)
        chunks = [t]
        for _ in range(num_chunks - 1):
            t += rng.expovariate(1 / 0.03)
            chunks.append(t)
        recs.append(record(f"r{i}", chunks, n=n, start=start, prompt_tokens=rng.randint(1, 900)))
    return recs


@dataclass(frozen=True)
class RequestOutput:
    """The fields of vLLM's RequestFuncOutput that calculate_metrics reads, as vllm bench serve fills them."""

    success: bool
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0


def _as_vllm(rec) -> RequestOutput:
    if not rec.is_ok:
        return RequestOutput(success=False, error=rec.error_kind or "")
    return RequestOutput(success=True, latency=rec.e2e_s, output_tokens=rec.output_tokens, ttft=rec.ttft_s,
                         itl=list(rec.itl_s), prompt_len=rec.prompt_tokens, start_time=rec.start_s)


@pytest.fixture(scope="module")
def vllm_metrics() -> dict[int, SimpleNamespace]:
    """vLLM's BenchmarkMetrics for each seed's records (one vLLM-venv process for all seeds; its answer, a function
    of the script, the records and the installed vLLM, is kept from run to run: importing vLLM costs ~18 s)."""
    python = vllm_python()
    if python is None:
        pytest.fail("the vLLM venv is missing: scripts/setup/vllm.sh builds .venv-vllm (make test runs it)")
    cases = [{"outputs": [asdict(_as_vllm(r)) for r in _random_records(seed)], "dur_s": DURATION_S,
              "percentiles": [50.0, 90.0, 99.0], "goodput": SLO_MS} for seed in SEEDS]
    request = json.dumps({"cases": cases})

    def run_vllm() -> str:
        proc = subprocess.run([str(python), str(VLLM_METRICS)], input=request, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{VLLM_METRICS.name} failed:\n{proc.stderr[-4000:]}"
        json.loads(proc.stdout)  # only a whole answer is kept
        return proc.stdout

    answer = json.loads(cached_answer("vllm-metrics", [VLLM_METRICS.read_text(), request, vllm_install(python)],
                                      run_vllm))
    return {seed: SimpleNamespace(**metrics) for seed, metrics in zip(SEEDS, answer["metrics"], strict=True)}


@pytest.mark.process
@pytest.mark.parametrize("seed", SEEDS)
def test_agrees_with_vllm_calculate_metrics(seed, vllm_metrics):
    recs = _random_records(seed)
    slo = SLO(ttft_ms=SLO_MS["ttft"], tpot_ms=SLO_MS["tpot"], e2e_ms=SLO_MS["e2el"])
    ours = summarize_level(8, recs, DURATION_S, slo)
    theirs = vllm_metrics[seed]
    assert ours.num_ok == theirs.completed and ours.num_errors + ours.num_cancelled == theirs.failed
    assert ours.output_tokens == theirs.total_output and ours.input_tokens == theirs.total_input
    for mine, ref in ((ours.request_throughput, theirs.request_throughput),
                      (ours.output_tok_s, theirs.output_throughput), (ours.total_tok_s, theirs.total_token_throughput),
                      (ours.goodput_req_s, theirs.request_goodput)):
        assert mine == pytest.approx(ref, rel=1e-12)
    assert theirs.request_goodput > 0  # the SLOs above leave some requests good and some not
    assert ours.goodput_req_s < ours.request_throughput
    for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        st = getattr(ours, key)
        assert st.mean == pytest.approx(getattr(theirs, f"mean_{name}_ms"), rel=1e-12)
        assert st.p50 == pytest.approx(getattr(theirs, f"median_{name}_ms"), rel=1e-12)
        ref_pcts = dict(getattr(theirs, f"percentiles_{name}_ms"))
        assert (st.p50, st.p90, st.p99) == pytest.approx((ref_pcts[50.0], ref_pcts[90.0], ref_pcts[99.0]), rel=1e-12)


CHAT_CHOICES = [  # (choice, carries a token): vllm bench serve's rule (`_choice_has_streamed_output`, vLLM 0.33)
    ({"delta": {"role": "assistant", "content": ""}}, False),
    ({"delta": {"content": ""}}, True),
    ({"delta": {"content": "hi"}}, True),
    ({"delta": {"reasoning": "hmm"}}, True),
    ({"delta": {"tool_calls": [{"index": 0}]}}, True),
    ({"delta": {}}, False),
    ({"delta": None}, False),
    ({"finish_reason": "stop"}, False),
]


@pytest.mark.parametrize("choice,expected", CHAT_CHOICES, ids=[str(c) for c, _ in CHAT_CHOICES])
def test_output_chunk_rule(choice, expected):
    assert has_output("chat", choice) is expected


def test_output_chunk_rule_extension_for_null_role():
    # {"role": null, "content": ""} is a token that decoded to no text, as pdcluster's nodes send it;
    # vLLM's rule only looks for the key, so it would miss such a token
    choice = {"delta": {"role": None, "content": ""}, "finish_reason": "length"}
    assert has_output("chat", choice)
    assert not has_output("chat", {"delta": {"role": "assistant", "content": ""}})
