"""`pdcluster loadgen compare A.json B.json`: a side-by-side table of two runs with B/A ratios.

Levels are matched by concurrency; levels present in only one run are listed as unmatched.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.metrics import LevelSummary
from loadgen.summary import Summary

# (label, getter); latency rows are p50/p99 in ms, throughput rows per second
ROWS: tuple[tuple[str, str], ...] = (
    ("requests ok", "num_ok"), ("errors", "num_errors"), ("cancelled", "num_cancelled"),
    ("requests/s", "request_throughput"), ("output tok/s", "output_tok_s"), ("total tok/s", "total_tok_s"),
    ("total tok/s/GPU", "total_tok_s_per_gpu"), ("goodput req/s", "goodput_req_s"),
    ("TTFT p50 ms", "ttft_ms.p50"), ("TTFT p99 ms", "ttft_ms.p99"), ("TPOT p50 ms", "tpot_ms.p50"),
    ("TPOT p99 ms", "tpot_ms.p99"), ("ITL p50 ms", "itl_ms.p50"), ("ITL p99 ms", "itl_ms.p99"),
    ("E2E p50 ms", "e2e_ms.p50"), ("E2E p99 ms", "e2e_ms.p99"), ("per-user tok/s p50", "per_user_tok_s.p50"),
    ("cached prompt tokens", "cached_tokens"), ("prompt cache hit ratio", "prompt_cache_hit_ratio"),
)


def _get(level: LevelSummary, path: str) -> float | None:
    value: object = level
    for part in path.split("."):
        value = getattr(value, part)
    return None if value is None else float(value)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value == int(value) else f"{value:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    if a == 0:
        return "=" if b == 0 else "inf"
    return f"{b / a:.2f}x"


@dataclass(frozen=True)
class LogprobMismatch:
    """Requests both runs completed with recorded log-probs, matched by request id (same schedule)."""

    num_requests: int
    num_tokens: int
    num_token_mismatches: int
    """Positions where the two runs served different tokens."""
    num_logprob_mismatches: int
    """Positions with the same token and a different log-prob (bit for bit: JSON floats compared exactly)."""


def logprob_mismatches(a: Summary, b: Summary) -> LogprobMismatch:
    ok_b = {r.request_id: r for lv in b.levels for r in lv.records if r.is_ok and r.logprobs}
    requests = tokens = token_diff = logprob_diff = 0
    for lv in a.levels:
        for ra in lv.records:
            rb = ok_b.get(ra.request_id)
            if not ra.is_ok or not ra.logprobs or rb is None:
                continue
            requests += 1
            tokens += min(len(ra.logprobs), len(rb.logprobs))
            token_diff += abs(len(ra.tokens) - len(rb.tokens))
            for ta, tb, la, lb in zip(ra.tokens, rb.tokens, ra.logprobs, rb.logprobs):
                token_diff += ta != tb
                logprob_diff += ta == tb and la != lb
    return LogprobMismatch(requests, tokens, token_diff, logprob_diff)


def logprob_line(m: LogprobMismatch) -> str:
    if not m.num_requests:
        return "log-probs: not recorded in both runs (run loadgen with --logprobs)"
    return (f"log-probs: {m.num_requests} requests, {m.num_tokens} tokens compared: {m.num_token_mismatches} token "
            f"mismatches, {m.num_logprob_mismatches} log-prob mismatches")


def compare_table(a: Summary, b: Summary, name_a: str = "A", name_b: str = "B") -> str:
    by_conc_b = {lv.concurrency: lv for lv in b.levels}
    lines = [f"A = {name_a}: {a.run.scenario} @ {a.run.url} (schedule {a.run.schedule_hash[:12]})",
             f"B = {name_b}: {b.run.scenario} @ {b.run.url} (schedule {b.run.schedule_hash[:12]})"]
    if a.run.schedule_hash != b.run.schedule_hash:
        lines.append("note: the runs used different request streams (schedule hashes differ)")
    width = max(len(label) for label, _ in ROWS)
    for lv_a in a.levels:
        lv_b = by_conc_b.get(lv_a.concurrency)
        if lv_b is None:
            continue
        lines += ["", f"concurrency {lv_a.concurrency}",
                  f"{'metric':<{width}}  {'A':>12}  {'B':>12}  {'B/A':>8}", "-" * (width + 40)]
        for label, path in ROWS:
            va, vb = _get(lv_a, path), _get(lv_b, path)
            lines.append(f"{label:<{width}}  {_cell(va):>12}  {_cell(vb):>12}  {ratio(va, vb):>8}")
    lines += ["", logprob_line(logprob_mismatches(a, b))]
    only_a = sorted({lv.concurrency for lv in a.levels} - set(by_conc_b))
    only_b = sorted(set(by_conc_b) - {lv.concurrency for lv in a.levels})
    if only_a or only_b:
        lines += ["", f"unmatched levels: only in A {only_a or '-'}, only in B {only_b or '-'}"]
    return "\n".join(lines)
