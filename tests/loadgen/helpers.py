"""Record builders shared by the loadgen tests."""

from __future__ import annotations

from loadgen.metrics import request_timing
from loadgen.records import RequestRecord


def record(rid: str, chunk_s: list[float], n: int | None = None, start: float = 0.0, outcome: str = "ok",
           kind: str | None = None, prompt_tokens: int = 10, concurrency: int = 1) -> RequestRecord:
    """A record as the client would write it: timing derived from the chunk times; n defaults to chunks."""
    num = len(chunk_s) if n is None else n
    timing = request_timing(start, chunk_s, num) if outcome == "ok" else None
    return RequestRecord(
        request_id=rid, concurrency=concurrency, outcome=outcome, error_kind=kind, start_s=start,
        end_s=(chunk_s[-1] if chunk_s else start) + 0.001, chunk_s=chunk_s, num_input_tokens=prompt_tokens,
        prompt_tokens=prompt_tokens, completion_tokens=n, output_tokens=num, tokens_from_usage=n is not None,
        ttft_s=timing.ttft_s if timing else None, e2e_s=timing.e2e_s if timing else None,
        tpot_s=timing.tpot_s if timing else None, itl_s=list(timing.itl_s) if timing else [])
