"""report.md: run settings, per-level throughput and p50/p90/p99 tables, errors, Pareto points, plots.

Every number comes from the Summary (itself computed from the raw records), so the report and
summary.json always agree.
"""

from __future__ import annotations

from pathlib import Path

from loadgen.metrics import LevelSummary, Stats
from loadgen.summary import Summary

LATENCY_ROWS = (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"),
                ("E2E (ms)", "e2e_ms"), ("per-user tok/s", "per_user_tok_s"))


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _stats_row(name: str, s: Stats) -> str:
    cells = [fmt(v) for v in (s.p50, s.p90, s.p99, s.mean, s.max)]
    return f"| {name} | {s.count} | " + " | ".join(cells) + " |"


def level_section(lv: LevelSummary) -> list[str]:
    lines = [f"## Concurrency {lv.concurrency}", "",
             f"duration {lv.duration_s:.2f} s; requests {lv.num_requests} (ok {lv.num_ok}, errors {lv.num_errors}, "
             f"cancelled {lv.num_cancelled}); token counts from chunks (no usage) for {lv.num_counted_by_chunks}", "",
             "| metric | count | p50 | p90 | p99 | mean | max |", "|---|---|---|---|---|---|---|"]
    lines += [_stats_row(name, getattr(lv, key)) for name, key in LATENCY_ROWS]
    lines += ["", "| throughput | value |", "|---|---|",
              f"| requests/s | {fmt(lv.request_throughput, 3)} |",
              f"| input tok/s | {fmt(lv.input_tok_s)} |", f"| output tok/s | {fmt(lv.output_tok_s)} |",
              f"| total tok/s | {fmt(lv.total_tok_s)} |",
              f"| total tok/s per GPU | {fmt(lv.total_tok_s_per_gpu)} |",
              f"| output tok/s per GPU | {fmt(lv.output_tok_s_per_gpu)} |",
              f"| input tok/s per prefill GPU | {fmt(lv.input_tok_s_per_prefill_gpu)} |",
              f"| output tok/s per decode GPU | {fmt(lv.output_tok_s_per_decode_gpu)} |",
              f"| goodput (req/s meeting every SLO) | {fmt(lv.goodput_req_s, 3)} |",
              f"| SLO attainment | {fmt(lv.slo_attainment, 3)} |"]
    if lv.errors_by_kind:
        lines += ["", "| error kind | count |", "|---|---|"]
        lines += [f"| {kind} | {num} |" for kind, num in lv.errors_by_kind.items()]
    return lines + [""]


def render_report(summary: Summary) -> str:
    run = summary.run
    lines = ["# Load generator report", "",
             f"- endpoint: {run.url} ({run.endpoint}), model `{run.model}`",
             f"- scenario: {run.scenario}, seed {run.seed}, schedule hash `{run.schedule_hash}` "
             f"(first {run.schedule_units} units)",
             f"- concurrency levels: {', '.join(map(str, run.concurrency_levels))}; duration {run.duration_s:g} s each",
             f"- GPUs: {run.gpus if run.gpus else 'not given (per-GPU columns empty)'}; SLO: {run.slo}",
             f"- started: {run.started_at}",
             "- TPOT = (E2E - TTFT)/(n - 1) per request (undefined for n = 1); ITL = every inter-chunk gap; "
             "percentiles by linear interpolation (numpy, as vllm bench serve)", ""]
    if summary.aborted:
        lines += [f"**Run stopped early:** {summary.aborted}", ""]
    if summary.input_errors:
        lines += [f"Skipped {len(summary.input_errors)} bad input line(s):", ""]
        lines += [f"- {err}" for err in summary.input_errors[:20]] + [""]
    lines += ["## Pareto points", "", "| concurrency | per-user tok/s (p50) | tok/s per GPU | on frontier |",
              "|---|---|---|---|"]
    lines += [f"| {p.concurrency} | {fmt(p.per_user_tok_s)} | {fmt(p.tok_s_per_gpu)} | {'yes' if p.on_frontier else ''} |"
              for p in summary.pareto]
    lines.append("")
    for lv in summary.levels:
        lines += level_section(lv)
    if summary.plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in summary.plots] + [""]
    return "\n".join(lines)


def write_report(summary: Summary, out_dir: Path) -> Path:
    path = out_dir / "report.md"
    path.write_text(render_report(summary))
    return path
