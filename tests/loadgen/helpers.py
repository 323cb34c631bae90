"""Record builders and report checks shared by the loadgen tests (and tests/e2e/test_loadgen_cluster.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loadgen.metrics import naive_percentile, request_timing
from loadgen.records import RequestRecord
from loadgen.summary import load_summary


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


def _recompute(records):
    ok = [r for r in records if r.is_ok]
    timings = [request_timing(r.start_s, r.chunk_s, r.output_tokens) for r in ok]
    return {"TTFT (ms)": [t.ttft_s * 1e3 for t in timings],
            "TPOT (ms)": [t.tpot_s * 1e3 for t in timings if t.tpot_s is not None],
            "ITL (ms)": [g * 1e3 for t in timings for g in t.itl_s],
            "E2E (ms)": [t.e2e_s * 1e3 for t in timings]}


def check_report_matches_records(out_dir: Path) -> None:
    """summary.json and report.md percentiles equal those recomputed from the raw chunk times."""
    summary = load_summary(out_dir / "summary.json")
    report = (out_dir / "report.md").read_text()
    sections = re.split(r"^## Concurrency (\d+)$", report, flags=re.M)
    by_level = {int(sections[i]): sections[i + 1] for i in range(1, len(sections), 2)}
    assert set(by_level) == {lv.concurrency for lv in summary.levels}
    for lv in summary.levels:
        for name, values in _recompute(lv.records).items():
            key = {"TTFT (ms)": "ttft_ms", "TPOT (ms)": "tpot_ms", "ITL (ms)": "itl_ms", "E2E (ms)": "e2e_ms"}[name]
            st = getattr(lv, key)
            assert st.count == len(values)
            row = re.search(rf"^\| {re.escape(name)} \| (\d+) \| ([^|]+)\| ([^|]+)\| ([^|]+)\|", by_level[lv.concurrency], re.M)
            assert row and int(row.group(1)) == len(values)
            for q, stored, shown in zip((50, 90, 99), (st.p50, st.p90, st.p99), row.groups()[1:]):
                if not values:
                    assert stored is None and shown.strip() == "-"
                    continue
                expected = naive_percentile(values, q)
                assert stored == pytest.approx(expected, rel=1e-9, abs=1e-9)
                assert shown.strip() == f"{expected:.2f}"
