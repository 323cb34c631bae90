"""`pdcluster loadgen ...` (run a sweep) and `pdcluster loadgen compare A.json B.json`.

    pdcluster loadgen --url http://127.0.0.1:8000 --scenario agentx --concurrency 1,4,16 --duration 60 \
        --out runs/agentx [--slo ttft=2000,tpot=100] [--gpus 8] [--seed 0]
    pdcluster loadgen --url URL --scenario trace --trace mooncake_trace.jsonl --trace-scale 0.05 --out DIR
    pdcluster loadgen --scenario agentx --seed 3 --dry-run         # print the schedule hash, send nothing
    pdcluster loadgen compare runs/a/summary.json runs/b/summary.json

Defaults come from LOADGEN_* environment variables (loadgen/settings.py); flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

PROG = "pdcluster loadgen"


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency wants integers like 1,4,16, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def _gpus(text: str) -> tuple[int, tuple[int, int] | None]:
    """"8" -> (8, None); "2+6" -> (8, (2, 6))."""
    try:
        parts = [int(x) for x in text.split("+")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants G or P+D (e.g. 8 or 2+6), got {text!r}") from None
    if len(parts) > 2 or any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"--gpus wants G or P+D with counts >= 1, got {text!r}")
    return sum(parts), (parts[0], parts[1]) if len(parts) == 2 else None


def build_parser(defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Drive an OpenAI-compatible endpoint and report "
                                "TTFT/TPOT/ITL/goodput. `pdcluster loadgen compare A.json B.json` compares two runs.")
    add = p.add_argument
    add("--url", default=defaults.url, help="base URL, e.g. http://127.0.0.1:8000 (env LOADGEN_URL)")
    add("--scenario", choices=("agentx", "random", "trace"), default="agentx")
    add("--trace", type=Path, help="Mooncake JSONL file (scenario trace)")
    add("--concurrency", type=_levels, default=[1], help="levels of the sweep, e.g. 1,4,16")
    add("--duration", type=float, default=60.0, help="seconds per level (new requests stop after it)")
    add("--out", type=Path, default=Path("loadgen-out"), help="output directory")
    add("--slo", default=None, help="ttft=MS,tpot=MS,e2e=MS: goodput counts requests meeting all")
    add("--gpus", type=_gpus, default=None, help="GPUs behind the endpoint (G, or P+D for prefill+decode GPUs)")
    add("--seed", type=int, default=0)
    add("--endpoint", choices=("chat", "completions"), default=defaults.endpoint)
    add("--model", default=defaults.model, help="model name (default: first of GET /v1/models)")
    add("--api-key", default=defaults.api_key)
    add("--max-requests", type=int, default=None, help="cap on requests started per level")
    add("--drain", type=float, default=defaults.drain_s, help="seconds in-flight requests get after --duration")
    add("--request-timeout", type=float, default=defaults.request_timeout_s)
    add("--connect-timeout", type=float, default=defaults.connect_timeout_s)
    add("--schedule-units", type=int, default=defaults.schedule_units, help="sessions the schedule hash covers")
    add("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may end early)")
    add("--logprobs", action="store_true", help="record every output token's log-prob (compare counts mismatches)")
    add("--no-plots", action="store_true")
    add("--progress", choices=("auto", "on", "off"), default="auto", help="live bar (auto: only on a TTY)")
    add("--dry-run", action="store_true", help="print the schedule hash and first requests; send nothing")
    g = p.add_argument_group("lengths (tokens) and delays (seconds): 512 | uniform:LO,HI | normal:M,S | "
                             "lognormal:MEDIAN,SIGMA | exp:MEAN")
    g.add_argument("--input-len", default="uniform:128,512", help="random: prompt length")
    g.add_argument("--output-len", default=None, help="random/agentx: output length")
    g.add_argument("--system-len", default="512", help="agentx: system prompt shared by all sessions")
    g.add_argument("--task-len", default="lognormal:256,0.5", help="agentx: user task (and sub-agent task)")
    g.add_argument("--tool-len", default="lognormal:128,0.8", help="agentx: tool result appended per turn")
    g.add_argument("--turns", default="uniform:4,12", help="agentx: turns per session")
    g.add_argument("--think-time", default="exp:0.5", help="agentx: tool pause before a turn")
    g.add_argument("--think-cap", type=float, default=10.0, help="agentx: cap on one pause")
    g.add_argument("--subagent-prob", type=float, default=0.15, help="agentx: chance a turn forks sub-agents")
    g.add_argument("--subagents", default="uniform:2,3", help="agentx: sub-agents per fork")
    g.add_argument("--subagent-turns", default="uniform:1,3", help="agentx: turns per sub-agent")
    g.add_argument("--max-context", type=int, default=16384, help="agentx: a session ends past this context")
    g.add_argument("--cancel-prob", type=float, default=0.0, help="agentx: chance the client interrupts a reply")
    g.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash id")
    g.add_argument("--trace-scale", type=float, default=1.0, help="trace: multiply lengths and block size")
    g.add_argument("--trace-speed", type=float, default=1.0, help="trace: replay this many times faster")
    return p


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        from loadgen.cli_compare import main_compare

        return main_compare(argv[1:])
    from loadgen.cli_run import main_run
    from loadgen.settings import Settings

    try:
        settings = Settings()
    except ValueError as exc:
        print(f"{PROG}: error: bad LOADGEN_* setting: {exc}", file=sys.stderr)
        return 2
    args = build_parser(settings).parse_args(argv)
    args.command = ["pdcluster", "loadgen", *argv]
    # SIGINT stops a run and keeps the partial level, also when a shell started this as a background job: it
    # starts those with SIGINT ignored, which asyncio.run would leave so (it only takes over the default handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return asyncio.run(main_run(args))
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; partial results in {args.out}", file=sys.stderr)
        return 130
