"""The shard plan as `pdcluster plan --shards` prints it: what one rank of a TP or DCP group holds of the weights.

    pdcluster plan --shards --model kimi-k3.1-pro --parallel tp8 [--rank 0] [--json]

Rows group the tensors of every layer of one kind (`layers.{i}.mixer.wq_b.weight` over the MLA layers), with their
split (engine/model/shards.py: attention_head, kda_head, expert, output_rows, replicated), shapes and bytes; the
totals say what the rank holds next to the whole model and to replicated + sharded / W.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass

PROG = "pdcluster plan --shards"


@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one name pattern (layer index replaced by {i})."""

    pattern: str
    kind: str
    count: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    rank_bytes: int
    full_bytes: int


def group_tensors(plan) -> list[TensorGroup]:  # noqa: ANN001 - engine.model.shards.ShardPlan
    groups: dict[tuple[str, str, tuple, tuple], list] = {}
    for t in plan.tensors:
        key = (re.sub(r"^layers\.\d+\.", "layers.{i}.", t.name), t.kind, t.full_shape, t.local_shape)
        groups.setdefault(key, []).append(t)
    return [TensorGroup(p, kind, len(ts), full, local, sum(t.local_bytes for t in ts), sum(t.full_bytes for t in ts))
            for (p, kind, full, local), ts in groups.items()]


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def render(plan) -> str:  # noqa: ANN001 - engine.model.shards.ShardPlan
    w = plan.world_size
    lines = [f"shard plan: {plan.model}, rank {plan.rank} of {plan.mode}{w} (weights as built: fp32 reference)", ""]
    rows = group_tensors(plan)
    width = max(len(r.pattern) for r in rows)
    lines.append(f"{'tensor':<{width}}  {'x':>3}  {'split':<14}  {'full shape':<22}  {'rank shape':<22}  rank bytes")
    for r in rows:
        lines.append(f"{r.pattern:<{width}}  {r.count:>3}  {r.kind:<14}  {str(list(r.full_shape)):<22}  "
                     f"{str(list(r.local_shape)):<22}  {_gb(r.rank_bytes)}")
    lines.append("")
    for kind, (mine, full) in plan.bytes_by_kind().items():
        if full:
            lines.append(f"{kind:<14}  rank {_gb(mine):>14}  of {_gb(full):>14}")
    goal = plan.replicated_bytes + plan.sharded_bytes / w
    lines.append(f"{'total':<14}  rank {_gb(plan.rank_bytes):>14}  of {_gb(plan.full_bytes):>14}  "
                 f"(replicated + sharded / {w} = {_gb(int(goal))})")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="What one rank of a TP or DCP group holds of the weights.")
    p.add_argument("--shards", action="store_true", required=True)
    p.add_argument("--model", default="kimi-k3.1-pro", help="preset, ModelConfig .json or checkpoint directory")
    p.add_argument("--parallel", default="tp8", help="tpN or dcpN: N ranks share the weights")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--json", action="store_true", help="every tensor's split and bytes as JSON")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from engine.model.config import resolve_model
    from engine.model.shards import shard_plan

    try:
        match = re.fullmatch(r"(tp|dcp)(\d+)", args.parallel)
        if match is None:
            raise ValueError(f"--parallel {args.parallel!r}: expected tpN or dcpN")
        plan = shard_plan(resolve_model(args.model), int(match.group(2)), args.rank, match.group(1))
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": plan.model, "world_size": plan.world_size, "rank": plan.rank, "mode": plan.mode,
                          "rank_bytes": plan.rank_bytes, "full_bytes": plan.full_bytes,
                          "replicated_bytes": plan.replicated_bytes, "sharded_bytes": plan.sharded_bytes,
                          "tensors": [{"name": t.name, "kind": t.kind, "full_shape": list(t.full_shape),
                                       "rank_shape": list(t.local_shape), "rank_bytes": t.local_bytes}
                                      for t in plan.tensors]}, indent=2))
    else:
        print(render(plan))
    return 0
