"""`pdcluster sim ...`: simulate a cluster under loadgen's workloads; `pdcluster sim calibrate`: measure a profile.

    pdcluster sim --config cluster/default.yaml --profile cpu-mini-reference --scenario agentx \\
        --concurrency 1,4 --duration 120 --out runs/sim-agentx [--seed 0] [--slo ttft=2000,tpot=100]
    pdcluster loadgen compare runs/real-agentx runs/sim-agentx      # measured and simulated side by side
    pdcluster sim calibrate --out sim/profiles/cpu-mini-reference.json [--quick]

Flags are loadgen's (`pdcluster loadgen --help`: scenario, concurrency, duration, workload shape, --out, --seed,
--slo, --gpus, --max-requests, --drain), with `--config CLUSTER.yaml` and `--profile FILE|NAME` in place of
`--url`. Flags about the HTTP client (--url, --api-key, --request-timeout, --connect-timeout, --logprobs,
--no-ignore-eos, --cancel-prob) have no simulated meaning and are refused when set. `--no-chunk-times` keeps
only each request's first and last chunk time (no ITL statistics; for long runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "pdcluster sim"

_CLIENT_ONLY = {"url": None, "api_key": None, "logprobs": False, "no_ignore_eos": False, "cancel_prob": 0.0}


def build_parser() -> argparse.ArgumentParser:
    from loadgen.cli import build_parser as loadgen_parser
    from loadgen.settings import Settings

    p = loadgen_parser(Settings(url=None, api_key=None))
    p.prog = PROG
    p.description = ("Simulate a pdcluster cluster (the real router and scheduler decisions, step times from a "
                     "profile) under loadgen's workloads; writes the same summary.json as `pdcluster loadgen`.")
    p.add_argument("--config", type=Path, default=None, help="cluster YAML (as `pdcluster up --config`; default: "
                   "cluster/default.yaml)")
    p.add_argument("--profile", required=False, default=None, help="profile JSON, or a name in sim/profiles/")
    p.add_argument("--no-chunk-times", action="store_true", help="keep first/last chunk times only (no ITL)")
    return p


def _refuse_client_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    defaults = {k: parser.get_default(k) for k in ("request_timeout", "connect_timeout", "progress", "endpoint")}
    for name, neutral in {**_CLIENT_ONLY, **defaults}.items():
        if getattr(args, name) != neutral:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is an HTTP-client flag of loadgen with no meaning in the simulator; drop it")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "calibrate":
        from sim.calibrate import main_calibrate

        return main_calibrate(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from cluster.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
    from loadgen.cli_run import build_workload, dry_run, print_table
    from loadgen.slo import parse_slo
    from sim.profile import resolve_profile
    from sim.run import SimOptions, simulate

    try:
        _refuse_client_flags(args, parser)
        workload, input_errors = build_workload(args)
        if args.dry_run:
            return dry_run(workload, args)
        if args.profile is None:
            raise ValueError("--profile is required (a JSON file, or a name in sim/profiles/)")
        if args.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {args.duration}")
        config_path = args.config or DEFAULT_CONFIG_PATH
        config = load_config(config_path)
        profile = resolve_profile(args.profile)
        slo = parse_slo(args.slo)
    except (ValueError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    gpus, split = args.gpus if args.gpus else (None, None)
    opts = SimOptions(concurrency_levels=args.concurrency, duration_s=args.duration, out_dir=args.out,
                      seed=args.seed, slo=slo, gpus=gpus, gpu_split=split, drain_s=args.drain,
                      max_requests=args.max_requests, schedule_units=args.schedule_units, plots=not args.no_plots,
                      record_chunks=not args.no_chunk_times, command=["pdcluster", "sim", *argv],
                      config_name=Path(config_path).name)
    try:
        result = simulate(config, profile, workload, args.scenario, opts)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    result.summary.input_errors = input_errors
    print_table(result.summary)
    print(f"simulated {result.simulated_s:.1f} s in {result.wall_s:.2f} s wall ({result.num_events} events); "
          f"wrote {args.out}/summary.json, report.md")
    return 0
