"""benchmarks/sim_validation.py `--requests`: a configuration's requests, real and simulated, side by side."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.sim_validation import request_pairs, request_table
from loadgen.records import RequestRecord


def _rec(rid: str, start: float, ttft: float, chunks: list[float], cached: int, ok: bool = True) -> RequestRecord:
    if not ok:
        return RequestRecord(request_id=rid, concurrency=1, outcome="error", start_s=start, end_s=start + 1.0)
    return RequestRecord(request_id=rid, concurrency=1, outcome="ok", start_s=start, end_s=start + chunks[-1],
                         chunk_s=[start + c for c in chunks], prompt_tokens=100, completion_tokens=5,
                         cached_tokens=cached, ttft_s=ttft, tpot_s=(chunks[-1] - chunks[0]) / 4)


def test_requests_pair_by_level_and_id_in_the_real_start_order() -> None:
    """Requests both sides completed pair up by id within their level, in the real side's start order; a request
    one side failed or never sent is counted, not paired; each row shows both sides' cached tokens, chunks, TTFT,
    TPOT and first-to-last chunk span."""
    real = SimpleNamespace(levels=[SimpleNamespace(concurrency=1, records=[
        _rec("b", 2.0, 0.5, [0.5, 0.9], 64), _rec("a", 1.0, 0.3, [0.3, 0.7], 0), _rec("c", 3.0, 0, [], 0, ok=False)]),
        SimpleNamespace(concurrency=4, records=[_rec("a", 9.0, 0.8, [0.8, 1.2], 96)])])
    sim = SimpleNamespace(levels=[SimpleNamespace(concurrency=1, records=[
        _rec("a", 1.1, 0.4, [0.4, 0.6, 0.8], 0), _rec("b", 2.2, 0.6, [0.6, 1.0], 32), _rec("d", 3.3, 0.2, [0.2], 0)]),
        SimpleNamespace(concurrency=4, records=[])])
    pairs = request_pairs(real, sim)
    assert [(c, rid) for c, rid, _, _ in pairs] == [(1, "a"), (1, "b")]
    lines = request_table("cfg", real, sim)
    rows = [line for line in lines if line.startswith("| 1 |")]
    assert rows == ["| 1 | a | 100 | 0 / 0 | 2 / 3 | 300 / 400 | 100.0 / 100.0 | 400 / 400 |",
                    "| 1 | b | 100 | 64 / 32 | 2 / 2 | 500 / 600 | 100.0 / 100.0 | 400 / 400 |"]
    assert lines[-1].strip() == "2 requests on both sides; 3 completed for real, 3 simulated"
