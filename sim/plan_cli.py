"""`pdcluster plan`: KV capacity of one instance (kv_transfer/cli.py, unchanged), with `--shards` what one rank holds
of the weights (cluster/shards.py), or with `--workload` a cluster plan searched by simulation (sim/planner.py).

    pdcluster plan --model kimi-k3.1-pro --gpu gb300 --gpus 8 --parallel tp8 ...       # capacity, as before
    pdcluster plan --shards --model kimi-k3.1-pro --parallel tp8 [--rank R] [--json]   # one rank's weight shard
    pdcluster plan --workload sim/workloads/agentx-gb300.yaml --slo ttft_p99=2s,tpot_p50=30ms --gpus 64 \\
        --gpu gb300 [--profile gb300-k31-pro] [--values-out plan.yaml] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "pdcluster plan"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Search prefill:decode ratios, TP/DCP sizes, block size, "
                                "chunk budget and KV dtype by simulating each candidate; print the Pareto set and "
                                "write the winner as Helm values.")
    p.add_argument("--workload", type=Path, required=True, help="YAML/JSON of loadgen flags (sim/planner.py)")
    p.add_argument("--slo", required=True, help="e.g. ttft_p99=2s,tpot_p50=30ms")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the cluster to plan")
    p.add_argument("--gpu", default="gb300", help="GPU kind (kv_transfer/capacity.py); picks the default profile")
    p.add_argument("--profile", default=None, help="profile JSON or name (default: gb300-k31-pro for gb300)")
    p.add_argument("--tp-context", type=int, default=131072, help="longest session the TP8 decode pool takes")
    p.add_argument("--max-batch", type=int, default=128, help="decode batch per instance (max_num_seqs)")
    p.add_argument("--top", type=int, default=3, help="shapes whose chunk/block/dtype variants are searched")
    p.add_argument("--values-out", type=Path, default=None, help="write the winner as Helm values here")
    p.add_argument("--json", type=Path, default=None, help="every candidate's figures as JSON")
    return p


DEFAULT_PROFILES = {"gb300": "gb300-k31-pro"}


def main(argv: list[str]) -> int:
    if "--shards" in argv:
        from cluster.shards import main as shards_main

        return shards_main(argv)
    if "--workload" not in argv and not any(a.startswith("--workload=") for a in argv):
        from kv_transfer.cli import main as capacity_main

        return capacity_main(argv)
    args = _parser().parse_args(argv)
    from sim.helm_values import render_values
    from sim.planner import Planner, load_workload, parse_objectives, winner
    from sim.profile import resolve_profile

    try:
        objectives = parse_objectives(args.slo)
        workload = load_workload(args.workload)
        name = args.profile or DEFAULT_PROFILES.get(args.gpu)
        if name is None:
            raise ValueError(f"--gpu {args.gpu}: no shipped profile; pass --profile")
        profile = resolve_profile(name)
        if profile.gpu is not None and profile.gpu != args.gpu:
            raise ValueError(f"--gpu {args.gpu} but profile {profile.name!r} is for {profile.gpu}")
        if args.gpus < 16 or args.gpus % 8:
            raise ValueError(f"--gpus {args.gpus}: instances take 4 or 8 GPUs; plan a multiple of 8, at least 16")
        planner = Planner(profile, workload, objectives, args.gpus, args.tp_context, args.max_batch, args.top,
                          log=lambda line: print(line, file=sys.stderr))
        outcomes = planner.search()
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    best = winner(outcomes)
    print(f"Pareto set (goodput per GPU vs {objectives[0].label}), {len(outcomes)} candidates simulated:")
    for o in sorted((o for o in outcomes if o.on_frontier), key=lambda o: -o.goodput_tok_s_per_gpu):
        lat = "  ".join(f"{k} {'-' if v is None else f'{v:.0f} ms'}" for k, v in o.latencies.items())
        print(f"  {o.shape.describe():<70} {o.goodput_tok_s_per_gpu:9.1f} tok/s/GPU  {lat}"
              f"{'  meets SLO' if o.meets_slo else ''}{'  <- winner' if o is best else ''}")
    if best not in [o for o in outcomes if o.on_frontier]:
        print(f"winner: {best.shape.describe()}")
    if not best.meets_slo:
        print("note: no candidate meets every SLO; the winner has the highest SLO attainment")
    if args.values_out:
        args.values_out.write_text(render_values(best, args.tp_context, args.max_batch, args.slo, profile.name))
        print(f"wrote {args.values_out}")
    if args.json:
        args.json.write_text(json.dumps([{
            "shape": o.shape.__dict__, "gpus": o.shape.gpus, "goodput_tok_s_per_gpu": o.goodput_tok_s_per_gpu,
            "attainment": o.attainment, "latencies_ms": o.latencies, "meets_slo": o.meets_slo,
            "on_frontier": o.on_frontier, "winner": o is best} for o in outcomes], indent=1))
    return 0
