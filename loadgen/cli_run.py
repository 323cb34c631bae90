"""The run half of the CLI: build the workload from flags, run the sweep, print the summary table."""

from __future__ import annotations

import argparse
import sys

from loadgen.client import Target
from loadgen.lengths import parse_dist
from loadgen.progress import Progress
from loadgen.report import fmt
from loadgen.schedule import Workload, schedule_hash
from loadgen.slo import parse_slo
from loadgen.summary import Summary
from loadgen.sweep import PreflightError, SweepOptions, run_sweep

PROG = "pdcluster loadgen"


class UsageError(ValueError):
    """Bad flags or input files; the message names the bad value."""


def build_workload(args: argparse.Namespace) -> tuple[Workload, list[str]]:
    """The scenario's workload and the bad input lines that were skipped (trace only)."""
    if args.scenario == "agentx":
        from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload

        cfg = AgentXConfig(
            seed=args.seed, system_len=parse_dist(args.system_len, "--system-len"),
            task_len=parse_dist(args.task_len, "--task-len"), tool_len=parse_dist(args.tool_len, "--tool-len"),
            output_len=parse_dist(args.output_len or "lognormal:64,0.5", "--output-len"),
            turns=parse_dist(args.turns, "--turns"), think_s=parse_dist(args.think_time, "--think-time"),
            think_cap_s=args.think_cap, subagent_prob=args.subagent_prob,
            num_subagents=parse_dist(args.subagents, "--subagents"),
            subagent_turns=parse_dist(args.subagent_turns, "--subagent-turns"), max_context=args.max_context,
            cancel_prob=args.cancel_prob)
        return AgentXWorkload(cfg), []
    if args.scenario == "random":
        from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload

        cfg = RandomConfig(seed=args.seed, input_len=parse_dist(args.input_len, "--input-len"),
                           output_len=parse_dist(args.output_len or "uniform:32,128", "--output-len"))
        return RandomWorkload(cfg), []
    return _trace_workload(args)


def _trace_workload(args: argparse.Namespace) -> tuple[Workload, list[str]]:
    from loadgen.scenarios.trace import TraceWorkload, read_trace

    if args.trace is None:
        raise UsageError("--scenario trace needs --trace FILE (Mooncake JSONL)")
    if args.trace_scale <= 0 or args.trace_speed <= 0 or args.trace_block_size < 1:
        raise UsageError("--trace-scale and --trace-speed must be > 0 and --trace-block-size >= 1")
    try:
        entries, errors = read_trace(args.trace, args.trace_scale)
    except OSError as exc:
        raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
    messages = [f"{args.trace}: {err}" for err in errors]
    for msg in messages[:10]:
        print(f"{PROG}: warning: skipping {msg}", file=sys.stderr)
    if len(messages) > 10:
        print(f"{PROG}: warning: ... and {len(messages) - 10} more bad lines", file=sys.stderr)
    if not entries:
        raise UsageError(f"trace {args.trace} has no valid line ({len(errors)} bad)")
    return TraceWorkload(entries, str(args.trace), args.trace_block_size, args.trace_scale, args.trace_speed), messages


def dry_run(workload: Workload, args: argparse.Namespace) -> int:
    print(f"scenario {workload.name}, seed {args.seed}")
    print(f"schedule hash {schedule_hash(workload, args.schedule_units)} (first {args.schedule_units} units)")
    for index in range(min(3, args.schedule_units)):
        session = workload.session(index)
        if session is None:
            break
        reqs = session.requests()
        sizes = ", ".join(f"{r.num_input_tokens}->{r.max_tokens}" for r in reqs[:8])
        print(f"  {session.session_id}: {len(reqs)} requests (in->out tokens: {sizes}{', ...' if len(reqs) > 8 else ''})")
    return 0


def print_table(summary: Summary) -> None:
    head = ("conc", "ok", "err", "canc", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "out tok/s",
            "user tok/s", "tok/s/GPU", "goodput")
    print(" ".join(f"{h:>10}" for h in head))
    for lv in summary.levels:
        row = (lv.concurrency, lv.num_ok, lv.num_errors, lv.num_cancelled, fmt(lv.ttft_ms.p50, 1),
               fmt(lv.ttft_ms.p99, 1), fmt(lv.tpot_ms.p50, 1), fmt(lv.tpot_ms.p99, 1), fmt(lv.output_tok_s, 1),
               fmt(lv.per_user_tok_s.p50, 1), fmt(lv.total_tok_s_per_gpu, 1), fmt(lv.goodput_req_s, 3))
        print(" ".join(f"{str(c):>10}" for c in row))
    for lv in summary.levels:
        if lv.errors_by_kind:
            print(f"c={lv.concurrency} errors: " + ", ".join(f"{k} {v}" for k, v in lv.errors_by_kind.items()))


def _options(args: argparse.Namespace) -> SweepOptions:
    if not args.url:
        raise UsageError("--url is required (or set LOADGEN_URL)")
    if args.duration <= 0:
        raise UsageError(f"--duration must be > 0, got {args.duration}")
    gpus, split = args.gpus if args.gpus else (None, None)
    base = args.url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https://, got {args.url!r}")
    try:
        slo = parse_slo(args.slo)
    except ValueError as exc:
        raise UsageError(f"--slo: {exc}") from None
    progress = Progress(enabled={"auto": None, "on": True, "off": False}[args.progress])
    target = Target(base, args.model, args.endpoint, args.api_key, not args.no_ignore_eos, logprobs=args.logprobs)
    return SweepOptions(target=target, concurrency_levels=args.concurrency, duration_s=args.duration,
                        out_dir=args.out, seed=args.seed, slo=slo, gpus=gpus, gpu_split=split, drain_s=args.drain,
                        max_requests=args.max_requests, connect_timeout_s=args.connect_timeout,
                        request_timeout_s=args.request_timeout, schedule_units=args.schedule_units,
                        plots=not args.no_plots, progress=progress, command=args.command)


async def main_run(args: argparse.Namespace) -> int:
    try:
        workload, input_errors = build_workload(args)
        if args.dry_run:
            return dry_run(workload, args)
        opts = _options(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = await run_sweep(workload, opts, args.scenario, input_errors)
    except PreflightError as exc:
        print(f"{PROG}: error: {exc}\n(wrote {opts.out_dir / 'summary.json'} and report.md)", file=sys.stderr)
        return 1
    print_table(summary)
    print(f"wrote {opts.out_dir}/summary.json, report.md" + (", " + ", ".join(summary.plots) if summary.plots else ""))
    if not any(lv.num_ok for lv in summary.levels):
        print(f"{PROG}: error: no request succeeded; see errors above and report.md", file=sys.stderr)
        return 1
    return 0
