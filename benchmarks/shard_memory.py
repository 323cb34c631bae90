"""Weight bytes and peak resident memory of a rank that builds only its shard (engine/model/shards.py).

For each model and each W, a fresh pool of W gloo rank processes (engine/parallel/groups.py `RankPool`) imports
torch, records its resident memory, builds its shard with `build_model(cfg, shard=ShardSpec(W, rank))` (seeded
random init, or `--checkpoint`-style directories through the loader when the model names one) and reports:
the bytes of its parameters, the plan's bytes (replicated + sharded / W), its peak RSS during the build (VmHWM,
reset just before it: the whole process's resident bytes, torch included, at the build's worst moment) and that
peak's growth over the RSS before the build. W = 1 is the whole model (a full
replica, what every rank held before). Goals (issue 35): weight bytes <= (replicated + sharded / W) * 1.05, and at
every W > 1 each rank's peak RSS <= the W = 1 process's.

`--kernels fast`: after the shard, the rank builds what a `--kernels fast` rank runs on it (the fast TP decoder and
SPMD prefiller, engine/parallel/fast_tp.py, fast_prefill.py; construction only, no step) and the peak covers both;
`fast_copy_bytes` are the decoder's own tensors (the bf16 copies; tensors it shares with the shard not counted),
goal <= the plan's bytes in bf16 (half the fp32 plan) * 1.05.

    python benchmarks/shard_memory.py [--models kimi-k3.1-mini benchmarks/k31_scaled.json] [--world-sizes 1 2 4]
                                      [--kernels reference|fast] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL_SLACK = 1.05


@dataclass(frozen=True)
class Row:
    model: str
    world_size: int
    rank: int
    weight_bytes: int
    goal_bytes: int
    """(replicated + sharded / W) * 1.05."""
    peak_rss_bytes: int
    """The process's peak resident bytes during the build."""
    build_rss_growth_bytes: int
    """Peak RSS minus the RSS before the build: what building the weights cost at its worst moment."""
    fast_copy_bytes: int = 0
    """`--kernels fast`: the bytes of the fast decoder's own tensors (0 with the reference kernels)."""


def _status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status (VmRSS: resident now, VmHWM: the peak since the last reset), bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start VmHWM afresh at the current RSS (Linux: 5 to clear_refs), so the peak is the build's own, not the
    process start's (spawning, imports and the gloo group's set-up peak before the build and differ with W)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def rank_build(ctx, model_name: str, kernels: str = "reference") -> dict:
    import gc

    import torch  # noqa: F401 - imported before the baseline, as every rank has it

    from engine.model.config import resolve_model
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model

    if kernels == "fast":  # imported before the baseline too (triton)
        from engine.layout import plan_layout
        from engine.parallel.fast_prefill import TPFastPrefiller
        from engine.parallel.fast_tp import TPFastDecoder
    cfg = resolve_model(model_name)
    gc.collect()
    _reset_peak()
    before = _status_bytes("VmRSS")
    model = build_model(cfg, shard=ShardSpec(ctx.world_size, ctx.rank))
    copies = 0
    if kernels == "fast":
        decoder = TPFastDecoder(model, plan_layout(cfg, tp_size=ctx.world_size), ctx)
        TPFastPrefiller(decoder)
        copies = _own_bytes(decoder, {p.untyped_storage().data_ptr() for p in model.parameters()})
    peak = _status_bytes("VmHWM")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weight_bytes": held, "peak_rss_bytes": peak, "growth": peak - before, "fast_copy_bytes": copies}


def _own_bytes(decoder, shared: set[int]) -> int:
    """Bytes of the distinct tensors the fast decoder holds (its layers' dicts, LM head) that are not the shard's."""
    import torch

    seen: dict[int, int] = {}
    values = [decoder.lm_head] + [v for layer in decoder.layers for d in (layer.mixer, layer.ffn) for v in d.values()]
    for v in values:
        for t in (v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["kimi-k3.1-mini", "benchmarks/k31_scaled.json"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kernels", default="reference", choices=["reference", "fast"],
                        help="fast: also build the fast TP decoder and prefiller on the shard")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from engine.model.config import resolve_model
    from engine.model.shards import shard_plan
    from engine.parallel.groups import RankPool

    rows: list[Row] = []
    for name in args.models:
        cfg = resolve_model(name)
        for w in args.world_sizes:
            with RankPool(w, backend="gloo", timeout_s=1800) as pool:  # fresh processes: ru_maxrss is per process
                results = pool.run(rank_build, name, args.kernels)
            for rank, res in enumerate(results):
                plan = shard_plan(cfg, w, rank)
                goal = int((plan.replicated_bytes + plan.sharded_bytes / w) * GOAL_SLACK)
                rows.append(Row(cfg.name, w, rank, res["weight_bytes"], goal, res["peak_rss_bytes"], res["growth"],
                                res["fast_copy_bytes"]))
            print(f"done {cfg.name} W={w}", file=sys.stderr, flush=True)
    whole_peak = {r.model: r.peak_rss_bytes for r in rows if r.world_size == 1}
    mib = 2**20
    fast = args.kernels == "fast"
    print(f"{args.kernels} kernels")
    print(f"{'model':<18} {'W':>2} {'rank':>4} {'weights MiB':>11} {'goal MiB':>9} {'peak RSS MiB':>12} "
          f"{'build growth MiB':>16}" + (f" {'fast copies MiB':>15}" if fast else "") + "  goals")
    verdicts = []
    for r in rows:
        weights_ok = r.weight_bytes <= r.goal_bytes and (not fast or r.fast_copy_bytes <= r.goal_bytes / 2)
        rss_ok = r.world_size == 1 or r.model not in whole_peak or r.peak_rss_bytes <= whole_peak[r.model]
        verdicts.append(weights_ok and rss_ok)
        print(f"{r.model:<18} {r.world_size:>2} {r.rank:>4} {r.weight_bytes / mib:>11.1f} {r.goal_bytes / mib:>9.1f} "
              f"{r.peak_rss_bytes / mib:>12.1f} {r.build_rss_growth_bytes / mib:>16.1f}"
              + (f" {r.fast_copy_bytes / mib:>15.1f}" if fast else "") + "  "
              f"weights {'met' if weights_ok else 'NOT met'}, peak RSS {'met' if rss_ok else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"kernels": args.kernels, "goals_met": all(verdicts),
                                         "whole_peak_rss_bytes": whole_peak, "rows": [asdict(r) for r in rows]},
                                        indent=2))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
