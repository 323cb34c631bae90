"""benchmarks/agent_sessions.py compares the two sides over the requests both completed: a closed loop cut at
--max-requests may send a few different requests on each side, and those must not move the headline's ratios."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "agent_sessions.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("agent_sessions_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(request_id: str, ttft_s: float, gaps: list[float]) -> dict:
    return {"request_id": request_id, "ttft_s": ttft_s, "itl_s": gaps}


def test_only_requests_both_sides_completed_count(bench) -> None:
    off = [_record("s0.t0", 9.0, [0.1]), _record("s0.t1", 4.0, [0.1, 0.2]), _record("s1.t3", 50.0, [30.0])]
    on = [_record("s0.t0", 9.0, [0.1]), _record("s0.t1", 1.0, [0.1, 0.3]), _record("s2.t1", 0.5, [0.1])]
    common = bench.on_common_requests(off, on)
    assert common["requests"] == 2 and common["only_off"] == ["s1.t3"] and common["only_on"] == ["s2.t1"]
    # turns >= 2 of the common set: s0.t1 alone (s0.t0 is a first turn)
    assert common["off"]["mean_ttft_turn2plus_s"] == 4.0 and common["on"]["mean_ttft_turn2plus_s"] == 1.0
    # the 30 s gap of the request only the cache-off side sent is not in its p99
    assert common["off"]["itl_p99_ms"] == pytest.approx(bench.percentile([100.0, 100.0, 200.0], 99))
    assert common["on"]["itl_p99_ms"] == pytest.approx(bench.percentile([100.0, 100.0, 300.0], 99))
