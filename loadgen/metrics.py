"""Metric math over raw records, following vllm bench serve (vllm/benchmarks/serve.py, 0.33.0):

- TTFT = first output chunk - send time; E2E = last output chunk - send time.
- TPOT = (E2E - TTFT) / (n - 1) with n the output token count (usage.completion_tokens, else the number
  of output chunks); undefined (None) for n = 1 and left out of TPOT statistics, but counted as 0 when
  checking a TPOT SLO, as vllm does.
- ITL = every gap between consecutive output chunks, pooled over requests (a chunk holding several tokens
  gives one gap, as in vllm).
- Only "ok" requests enter latency and throughput statistics; errors and cancelled streams are counted.
- Percentiles are numpy's linear interpolation (`np.percentile`), as vllm uses; `naive_percentile` is the
  pure-Python reference.
- per-user tok/s of a request = 1 / TPOT; the Pareto point of a level is (median per-user tok/s,
  total tok/s / GPUs) as InferenceX plots it.
- goodput = requests meeting every SLO / level duration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel

from loadgen.records import RequestRecord
from loadgen.slo import SLO

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]


def request_timing(start_s: float, chunk_s: list[float], num_output_tokens: int) -> RequestTiming | None:
    """Timing of one request from its send time and output-chunk times; None without any chunk."""
    if not chunk_s:
        return None
    ttft = chunk_s[0] - start_s
    e2e = chunk_s[-1] - start_s
    itl = tuple(b - a for a, b in zip(chunk_s, chunk_s[1:]))
    tpot = (e2e - ttft) / (num_output_tokens - 1) if num_output_tokens > 1 else None
    return RequestTiming(ttft, e2e, tpot, itl)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def naive_percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), in plain Python."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


class Stats(BaseModel):
    """count, mean, min, max and p50/p90/p99 of one metric (None when count is 0)."""

    count: int = 0
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


def stats(values: list[float], scale: float = 1.0) -> Stats:
    if not values:
        return Stats()
    arr = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = (float(np.percentile(arr, q)) for q in PERCENTILES)
    return Stats(count=len(values), mean=float(arr.mean()), min=float(arr.min()), max=float(arr.max()),
                 p50=p50, p90=p90, p99=p99)


class LevelSummary(BaseModel):
    """Everything measured at one concurrency level, with the raw records it came from. Record times are
    seconds after `started_unix` (wall clock), to line them up with server logs and Prometheus."""

    concurrency: int
    started_unix: float | None = None
    duration_s: float
    num_requests: int
    num_ok: int
    num_errors: int
    num_cancelled: int
    num_counted_by_chunks: int
    errors_by_kind: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    input_tok_s: float
    output_tok_s: float
    total_tok_s: float
    gpus: int | None = None
    total_tok_s_per_gpu: float | None = None
    output_tok_s_per_gpu: float | None = None
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    input_tok_s_per_prefill_gpu: float | None = None
    output_tok_s_per_decode_gpu: float | None = None
    goodput_req_s: float | None = None
    slo_attainment: float | None = None
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    per_user_tok_s: Stats
    cached_tokens: int | None = None
    """Prompt tokens of ok requests a prefix cache supplied (usage cached_tokens; None: never reported)."""
    prompt_cache_hit_ratio: float | None = None
    """cached_tokens / prompt tokens over the ok requests that reported cached_tokens."""
    records: list[RequestRecord]


def count_good(records: list[RequestRecord], slo: SLO) -> int:
    """Requests that completed and meet every SLO."""
    return sum(1 for r in records if r.is_ok and slo.is_met(r.ttft_s, r.tpot_s, r.e2e_s))


def summarize_level(concurrency: int, records: list[RequestRecord], duration_s: float, slo: SLO,
                    gpus: int | None = None, started_unix: float | None = None,
                    split: tuple[int, int] | None = None) -> LevelSummary:
    """`gpus` = all GPUs behind the endpoint; `split` = (prefill GPUs, decode GPUs) of a disaggregated
    deployment, for InferenceX's input tok/s per prefill GPU and output tok/s per decode GPU."""
    ok = [r for r in records if r.is_ok]
    dur = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.num_input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    total_tok_s = (input_tokens + output_tokens) / dur
    good = None if slo.is_empty else count_good(records, slo)
    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens for r in reporting) if reporting else None
    return LevelSummary(
        concurrency=concurrency,
        started_unix=started_unix,
        duration_s=duration_s,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=sum(1 for r in records if r.outcome == "error"),
        num_cancelled=sum(1 for r in records if r.outcome == "cancelled"),
        num_counted_by_chunks=sum(1 for r in ok if not r.tokens_from_usage),
        errors_by_kind=dict(sorted(Counter(r.error_kind or r.outcome for r in records if not r.is_ok).items())),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / dur,
        input_tok_s=input_tokens / dur,
        output_tok_s=output_tokens / dur,
        total_tok_s=total_tok_s,
        gpus=gpus,
        total_tok_s_per_gpu=total_tok_s / gpus if gpus else None,
        output_tok_s_per_gpu=output_tokens / dur / gpus if gpus else None,
        prefill_gpus=split[0] if split else None,
        decode_gpus=split[1] if split else None,
        input_tok_s_per_prefill_gpu=input_tokens / dur / split[0] if split else None,
        output_tok_s_per_decode_gpu=output_tokens / dur / split[1] if split else None,
        goodput_req_s=None if good is None else good / dur,
        slo_attainment=None if good is None or not records else good / len(records),
        ttft_ms=stats([r.ttft_s for r in ok], 1000.0),
        tpot_ms=stats(tpots, 1000.0),
        itl_ms=stats([g for r in ok for g in r.itl_s], 1000.0),
        e2e_ms=stats([r.e2e_s for r in ok], 1000.0),
        per_user_tok_s=stats([1.0 / t for t in tpots if t > 0]),
        cached_tokens=cached,
        prompt_cache_hit_ratio=cached / sum(r.prompt_tokens for r in reporting) if reporting else None,
        records=records,
    )


class ParetoPoint(BaseModel):
    concurrency: int
    per_user_tok_s: float | None
    tok_s_per_gpu: float
    on_frontier: bool = False


def pareto_points(levels: list[LevelSummary]) -> list[ParetoPoint]:
    """One point per level (y is total tok/s per GPU, or total tok/s when GPUs are unknown)."""
    points = [ParetoPoint(concurrency=lv.concurrency, per_user_tok_s=lv.per_user_tok_s.p50,
                          tok_s_per_gpu=lv.total_tok_s_per_gpu if lv.gpus else lv.total_tok_s) for lv in levels]
    valid = [p for p in points if p.per_user_tok_s is not None]
    for p in valid:
        p.on_frontier = not any(
            q is not p and q.per_user_tok_s >= p.per_user_tok_s and q.tok_s_per_gpu >= p.tok_s_per_gpu
            and (q.per_user_tok_s > p.per_user_tok_s or q.tok_s_per_gpu > p.tok_s_per_gpu) for q in valid)
    return points


def throughput_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tok/s per time bin (bin starts, rates) over ok records; a chunk's tokens = n / chunks."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if r.is_ok and r.chunk_s:
            times += r.chunk_s
            weights += [r.output_tokens / len(r.chunk_s)] * len(r.chunk_s)
    if not times:
        return [], []
    num_bins = int(max(times) // bin_s) + 1
    counts = np.zeros(num_bins)
    np.add.at(counts, (np.asarray(times) // bin_s).astype(int), weights)
    return [i * bin_s for i in range(num_bins)], list(counts / bin_s)
