"""DCP global top-k merge: bytes per query per rank, merge time and fallback rate, compact vs generic.

Real gloo ranks (one torch thread each, pinned round-robin to this machine's cores), or NCCL ranks with
`--backend nccl --device cuda` (one GPU per rank, scores and merges on the GPU), run
`engine.parallel.dcp_merge` on indexer-like scores for a context of --context tokens, owned by DCP rank
in aligned runs of --interleave tokens. Inputs: `random` (standard normal scores) and `adversarial`
(every high score on rank 0, which saturates it and forces the exact second round). Every measured
selection is checked against the monolithic stable top-k before its numbers are reported.

    python benchmarks/dcp.py [--world-sizes 2 4 8] [--topk 256 2048] [--json PATH]
    python benchmarks/dcp.py --backend nccl --device cuda --world-sizes 2 --topk 2048

Headline: compact/generic bytes per query per rank at W=8, k=2048 on random inputs (goal <= 1/8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Case:
    world_size: int
    topk: int
    inputs: str
    method: str
    key_bits: int | None
    bytes_per_query: float
    merge_ms: float
    fallback_rate: float


def make_scores(rows: int, context: int, inputs: str, world_size: int, interleave: int, seed: int):
    import torch

    from engine.parallel.dcp_layout import DCPLayout

    scores = torch.randn(rows, context, generator=torch.Generator().manual_seed(seed))
    if inputs == "adversarial":
        owner = DCPLayout(world_size, interleave).owner(torch.arange(context))
        scores = torch.where(owner[None] == 0, scores.abs() + 10.0, scores.abs())
    return scores


def rank_bench(ctx, rows: int, context: int, topk: int, inputs: str, method: str, key_bits, interleave: int,
               reps: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from engine.parallel.dcp_layout import DCPLayout
    from engine.parallel.dcp_merge import compact_merge, generic_merge

    layout = DCPLayout(ctx.world_size, interleave)
    scores = make_scores(rows, context, inputs, ctx.world_size, interleave, seed)
    cuda = ctx.device.type == "cuda"
    with torch.device(ctx.device) if cuda else contextlib.nullcontext():
        local = layout.shard(scores.to(ctx.device), ctx.rank, 1)
        gids = layout.global_ids(ctx.rank, local.shape[1])
        times, result = [], None
        for _ in range(reps):
            dist.barrier(group=ctx.group)
            if cuda:
                torch.cuda.synchronize(ctx.device)
            start = time.perf_counter()
            if method == "compact":
                result = compact_merge(ctx, local, topk, layout, key_bits=key_bits)
            else:
                result = generic_merge(ctx, local, topk, layout)
            if cuda:
                torch.cuda.synchronize(ctx.device)
            times.append(time.perf_counter() - start)
        own = [gids[row[row >= 0]].cpu() for row in result.local_ids]
    return {"own": own, "bytes": result.bytes_sent, "fallback": result.num_fallback_rows,
            "ms": sorted(times)[len(times) // 2] * 1e3}


def run_case(pool, args, topk: int, inputs: str, method: str, key_bits) -> Case:
    import torch

    from engine.parallel.dcp_merge import naive_topk_ids

    w = pool.world_size
    results = pool.run(rank_bench, args.rows, args.context, topk, inputs, method, key_bits, args.interleave,
                       args.reps, args.seed)
    want = naive_topk_ids(make_scores(args.rows, args.context, inputs, w, args.interleave, args.seed), topk)
    for b in range(args.rows):
        got = torch.cat([r["own"][b] for r in results]).sort().values
        if not torch.equal(got, want[b][want[b] >= 0]):
            raise SystemExit(f"selection mismatch: W={w} k={topk} {inputs} {method} row {b}")
    return Case(w, topk, inputs, method, key_bits,
                bytes_per_query=max(r["bytes"] for r in results) / args.rows,
                merge_ms=max(r["ms"] for r in results),
                fallback_rate=results[0]["fallback"] / args.rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--topk", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--context", type=int, default=32768, help="tokens per query row")
    parser.add_argument("--rows", type=int, default=16, help="query rows per merge call")
    parser.add_argument("--interleave", type=int, default=64, help="DCP ownership run (sub-block) in tokens")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU ranks) or nccl (one GPU per rank)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs --backend nccl")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if (args.device == "cuda") != (args.backend == "nccl"):
        parser.error("--device cuda goes with --backend nccl (one GPU per rank), --device cpu with gloo")

    from engine.parallel.groups import RankPool

    variants = [("random", "generic", None), ("random", "compact", 32), ("random", "compact", 16),
                ("adversarial", "generic", None), ("adversarial", "compact", 32)]
    cases: list[Case] = []
    for w in args.world_sizes:
        with RankPool(w, backend=args.backend, timeout_s=600) as pool:
            for topk in args.topk:
                for inputs, method, key_bits in variants:
                    cases.append(run_case(pool, args, topk, inputs, method, key_bits))
    print(f"context {args.context}, {args.rows} query rows per call, interleave {args.interleave}, "
          f"{args.backend} ranks on {args.device}")
    print(f"{'W':>2} {'k':>5} {'inputs':<11} {'method':<8} {'key':>4} {'B/query/rank':>12} "
          f"{'merge ms':>9} {'fallback':>8} {'bytes vs generic':>16}")
    generic = {(c.world_size, c.topk, c.inputs): c for c in cases if c.method == "generic"}
    for c in cases:
        ratio = c.bytes_per_query / generic[(c.world_size, c.topk, c.inputs)].bytes_per_query
        key = "-" if c.method == "generic" else str(c.key_bits)
        print(f"{c.world_size:>2} {c.topk:>5} {c.inputs:<11} {c.method:<8} {key:>4} {c.bytes_per_query:>12.0f} "
              f"{c.merge_ms:>9.2f} {c.fallback_rate:>8.3f} {ratio:>16.4f}")
    w_head = 8 if 8 in args.world_sizes else max(args.world_sizes)
    head = [c for c in cases if (c.world_size, c.topk, c.inputs, c.method, c.key_bits) == (w_head, 2048, "random",
                                                                                              "compact", 32)]
    if args.json:
        value = head[0].bytes_per_query / generic[(w_head, 2048, "random")].bytes_per_query if head else None
        args.json.write_text(json.dumps({
            "headline": {"metric": f"dcp_compact_over_generic_bytes_W{w_head}_k2048", "value": value,
                         "goal": 1 / w_head},
            "backend": args.backend, "device": args.device,
            "context": args.context, "rows": args.rows, "interleave": args.interleave,
            "cases": [asdict(c) for c in cases]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
