"""`pdcluster plan`: packed-row layout and KV capacity for a model preset, GPU and parallelism.

    pdcluster plan --model kimi-k3.1-pro --gpu gb300 --gpus 8 --parallel tp8|dcp8 --latent fp8|nvfp4
                   --index-key fp8|mxfp4 [--kv-budget-gb X] [--block-size N] [--json]
Budget assumptions: kv_transfer/capacity.py. `--json` prints the CapacityPlan fields (bytes_per_token_per_gpu,
block_size, tokens_per_instance, full_contexts, ...).
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-k3.1-pro")
    p.add_argument("--gpu", default="gb300")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--parallel", default="tp8", help="tpN or dcpN (DCP inside a TP group of N)")
    p.add_argument("--latent", default="fp8", choices=("fp8", "nvfp4"))
    p.add_argument("--index-key", default="fp8", choices=("fp8", "mxfp4"))
    p.add_argument("--kv-budget-gb", type=float, default=None, help="row-pool GB per GPU (default: inferred)")
    p.add_argument("--block-size", type=int, default=None, help="force a larger power-of-two block")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from engine.model.config import get_preset  # noqa: PLC0415
    from kv_transfer.capacity import plan_capacity  # noqa: PLC0415

    try:
        cfg = get_preset(args.model)
        budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 1e9)
        plan = plan_capacity(cfg, args.gpu, args.gpus, args.parallel, args.latent, args.index_key, budget,
                             args.block_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    d = plan.to_dict()
    width = max(map(len, d))
    for key, value in d.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
        print(f"{key:<{width}}  {shown}")
    return 0
