"""TP vs DCP decode on W ranks: time per output token (one decode step) and KV bytes per rank, side by side.

Real gloo ranks (one torch thread each, pinned round-robin), or NCCL ranks with `--backend nccl --device cuda`,
run `engine.parallel.dcp_decode.parallel_decode` for B requests of C cached tokens each, in mode `tp` (every rank
holds the whole attention cache; MLA heads split) and mode `dcp` (each rank holds 1/W of the tokens in aligned
runs of --interleave tokens; exact compact top-k merge + LSE merge). KDA heads are split in both. The modes
alternate step by step in one pool, so machine noise hits both. Cache contents are synthetic (random values
stored as the engine stores them: FP8 latents at the model's static scale, FP8 index keys with row scales);
a decode step's work does not depend on them. Reported per (W, C, B): median step time of the slowest rank,
attention rows held per rank, DCP merge bytes per step per rank.

    python benchmarks/decode.py [--world-sizes 2] [--contexts 8192 32768] [--batches 1 8] [--steps 7] [--json PATH]
    python benchmarks/decode.py --backend nccl --device cuda --world-sizes 2 --contexts 32768 131072

`--kernels fast` runs the fast decode steps instead (engine/parallel/fast_tp.py `TPFastDecoder`, fast_dcp.py
`DCPFastDecoder`, bf16, torch segments compiled on CUDA; each rank on its shard of the weights, as a node's rank)
over packed row pools as a node holds them (TP: every
rank the whole rows; DCP: a pool planned with dcp_size = W, each rank its owned tokens), same synthetic rows;
the two fast steps are not bit-equal (keys split over ranks), so their next tokens are counted, not required
to agree.

    python benchmarks/decode.py --kernels fast --backend nccl --device cuda --world-sizes 2 --contexts 32768

Headline: TPOT(dcp) / TPOT(tp) at the first world size, the longest context, batch 1: what holding W x the
tokens costs per token. `--model` takes a preset name or a ModelConfig JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("tp", "dcp")


@dataclass(frozen=True)
class Row:
    world_size: int
    context: int
    batch: int
    tp_ms: float
    dcp_ms: float
    tp_kv_mib_per_rank: float
    dcp_kv_mib_per_rank: float
    dcp_merge_kib_per_step: float

    @property
    def dcp_over_tp(self) -> float:
        return self.dcp_ms / self.tp_ms


def rank_run(ctx, preset: str, context: int, batch: int, steps: int, interleave: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from engine.model.config import preset_or_file
    from engine.model.numerics import device_scope, fp8_quantize_rowwise, fp8_quantize_static
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.dcp_cache import DCPRankCache
    from engine.parallel.dcp_decode import parallel_decode
    from engine.parallel.dcp_layout import DCPLayout
    from engine.parallel.kda_shard import rank_cache

    cfg = preset_or_file(preset)
    model = build_model(cfg, device=ctx.device, shard=ShardSpec(ctx.world_size, ctx.rank))
    layout = DCPLayout(ctx.world_size, interleave)
    capacity = context + steps + 1
    gen = torch.Generator().manual_seed(seed)
    cuda = ctx.device.type == "cuda"
    with device_scope(ctx.device):
        caches = {"tp": [rank_cache(cfg, capacity, ctx.world_size, ctx.rank) for _ in range(batch)],
                  "dcp": [DCPRankCache(cfg, capacity, layout, ctx.rank) for _ in range(batch)]}
        for i in range(cfg.num_mla_layers):  # the same synthetic rows for every request and both modes
            latent = fp8_quantize_static(torch.randn(context, cfg.latent_dim, generator=gen, device="cpu"), cfg.latent_fp8_scale)
            keys, scales = fp8_quantize_rowwise(torch.randn(context, cfg.index_head_dim, generator=gen, device="cpu"))
            latent, keys, scales = latent.to(ctx.device), keys.to(ctx.device), scales.to(ctx.device)
            for mode in MODES:
                for cache in caches[mode]:
                    cache.write_attention(i, 0, latent, keys, scales)
        row_bytes = cfg.num_mla_layers * (cfg.latent_dim + cfg.index_head_dim + 4)
        kv = {"tp": context * row_bytes, "dcp": layout.num_local(ctx.rank, context) * row_bytes}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        merge_bytes, argmax = [], {mode: [] for mode in MODES}
        for step in range(steps + 1):  # step 0 warms up, untimed
            tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device="cpu").to(ctx.device)
            positions = [context + step] * batch
            for mode in (MODES if step % 2 == 0 else MODES[::-1]):
                if not ctx.is_single:  # one rank has no process group to wait on
                    dist.barrier(group=ctx.group)
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                start = time.perf_counter()
                result = parallel_decode(ctx, model, tokens, positions, caches[mode], mode=mode, layout=layout)
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                argmax[mode].append(result.logits.argmax(-1).tolist())
                if step:
                    times[mode].append(time.perf_counter() - start)
                    if mode == "dcp":
                        merge_bytes.append(result.stats.merge_bytes)
    return {"ms": {mode: statistics.median(times[mode]) * 1e3 for mode in MODES}, "kv": kv,
            "merge_bytes": statistics.median(merge_bytes), "argmax": argmax}


def rank_run_fast(ctx, preset: str, context: int, batch: int, steps: int, interleave: int, seed: int) -> dict:
    """`rank_run` with the fast TP and DCP decoders over packed row pools (see the module doc)."""
    import torch
    import torch.distributed as dist

    from engine.cache import DCPRowCache, RowPool, RowSequenceCache
    from engine.fast.model import decode_on_pool
    from engine.layout import plan_layout
    from engine.model.config import preset_or_file
    from engine.model.numerics import fp8_quantize_rowwise, fp8_quantize_static
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.fast_dcp import DCPFastDecoder, decode_on_dcp_pool
    from engine.parallel.fast_tp import TPFastDecoder

    cfg = preset_or_file(preset)
    model = build_model(cfg, device=ctx.device, shard=ShardSpec(ctx.world_size, ctx.rank))
    w = ctx.world_size
    layouts = {"tp": plan_layout(cfg, tp_size=w),
               "dcp": plan_layout(cfg, tp_size=w, dcp_size=w, dcp_interleave=interleave)}
    capacity = context + steps + 1
    gen = torch.Generator().manual_seed(seed)
    cuda = ctx.device.type == "cuda"
    caches, pools = {}, {}
    for mode, layout in layouts.items():
        pools[mode] = pool = RowPool(layout, cfg, batch * sum(layout.rows_per_request(capacity)), device=ctx.device)
        tables = [pool.allocate_request(capacity) for _ in range(batch)]
        caches[mode] = [RowSequenceCache(pool, t) if mode == "tp" else DCPRowCache(pool, t, ctx.rank)
                        for t in tables]
    for i in range(cfg.num_mla_layers):  # the same synthetic rows for every request and both modes
        latent = fp8_quantize_static(torch.randn(context, cfg.latent_dim, generator=gen), cfg.latent_fp8_scale)
        keys, scales = fp8_quantize_rowwise(torch.randn(context, cfg.index_head_dim, generator=gen))
        for mode in layouts:
            for cache in caches[mode]:
                if mode == "tp":
                    pools[mode].write_attention(cache.table, i, 0, latent, keys, scales)
                else:
                    cache.write_attention(i, 0, latent, keys, scales)
    decoders = {"tp": TPFastDecoder(model, layouts["tp"], ctx, compile=cuda),
                "dcp": DCPFastDecoder(model, layouts["dcp"], ctx, compile=cuda)}
    row_bytes = cfg.num_mla_layers * (cfg.latent_dim + cfg.index_head_dim + 4)
    kv = {"tp": context * row_bytes, "dcp": decoders["dcp"].dcp.num_local(ctx.rank, context) * row_bytes}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    merge_bytes, argmax = [], {mode: [] for mode in MODES}
    with torch.no_grad():
        for step in range(steps + 2):  # steps 0 and 1 warm up (compilation), untimed
            tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
            positions = [context + step] * batch
            for mode in (MODES if step % 2 == 0 else MODES[::-1]):
                if not ctx.is_single:
                    dist.barrier(group=ctx.group)
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                start = time.perf_counter()
                if mode == "tp":
                    logits = decode_on_pool(decoders["tp"], layouts["tp"], tokens, positions, caches["tp"])
                else:
                    logits = decode_on_dcp_pool(decoders["dcp"], tokens, positions, caches["dcp"])
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                argmax[mode].append(logits.argmax(-1).tolist())
                if step > 1:
                    times[mode].append(time.perf_counter() - start)
                if mode == "dcp":
                    if step > 1:
                        merge_bytes.append(decoders["dcp"].merge_bytes)
                    decoders["dcp"].merge_bytes = 0
    return {"ms": {mode: statistics.median(times[mode]) * 1e3 for mode in MODES}, "kv": kv,
            "merge_bytes": statistics.median(merge_bytes), "argmax": argmax}


def measure(pool, args, context: int, batch: int) -> Row:
    run = rank_run_fast if args.kernels == "fast" else rank_run
    results = pool.run(run, args.model, context, batch, args.steps, args.interleave, args.seed)
    if args.kernels == "fast":  # not bit-equal: report how often the next tokens agree
        pairs = [(a, b) for r in results for s_a, s_b in zip(r["argmax"]["tp"], r["argmax"]["dcp"])
                 for a, b in zip(s_a, s_b)]
        print(f"fast TP and DCP steps: next token equal on {sum(a == b for a, b in pairs)} of {len(pairs)}",
              file=sys.stderr, flush=True)
    elif any(r["argmax"]["tp"] != r["argmax"]["dcp"] for r in results):  # same caches, same tokens: same argmax
        raise SystemExit(f"TP and DCP decode disagree on the next token (context {context}, batch {batch})")
    slowest = {mode: max(r["ms"][mode] for r in results) for mode in MODES}
    return Row(pool.world_size, context, batch, slowest["tp"], slowest["dcp"],
               max(r["kv"]["tp"] for r in results) / 2**20, max(r["kv"]["dcp"] for r in results) / 2**20,
               max(r["merge_bytes"] for r in results) / 2**10)


def print_table(rows: list[Row], args) -> None:
    print(f"{args.model}, {args.kernels} kernels, {args.backend} ranks on {args.device}; step = one output token "
          f"per request, median of "
          f"{args.steps}, slowest rank")
    print(f"{'W':>2} {'context':>8} {'batch':>5} | {'TP ms':>8} {'DCP ms':>8} {'DCP/TP':>6} | "
          f"{'KV MiB/rank TP':>14} {'DCP':>8} | {'merge KiB/step':>14}")
    for r in rows:
        print(f"{r.world_size:>2} {r.context:>8} {r.batch:>5} | {r.tp_ms:8.1f} {r.dcp_ms:8.1f} {r.dcp_over_tp:6.2f} | "
              f"{r.tp_kv_mib_per_rank:14.2f} {r.dcp_kv_mib_per_rank:8.2f} | {r.dcp_merge_kib_per_step:14.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi-k3.1-mini")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--interleave", type=int, default=512, help="DCP ownership run in tokens (mini at DCP2: 512)")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU ranks) or nccl (one GPU per rank)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs --backend nccl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", default="reference", choices=["reference", "fast"],
                        help="fast: the fast TP / DCP decoders over packed row pools "
                             "(CPU: under the Triton interpreter, turned on here: slow)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if (args.device == "cuda") != (args.backend == "nccl"):
        parser.error("--device cuda goes with --backend nccl (one GPU per rank), --device cpu with gloo")
    if args.steps < 1 or min(args.contexts) < 1 or min(args.batches) < 1:
        parser.error("--steps, --contexts and --batches must be positive")
    if args.kernels == "fast" and min(args.world_sizes) < 2:
        parser.error("--kernels fast compares the fast TP and DCP decoders on W >= 2 ranks (a DCP pool of one rank "
                     "is the TP pool); the single-rank fast decode is measured by benchmarks/engine.py")

    if args.kernels == "fast" and args.device == "cpu":  # the Triton kernels on CPU: the interpreter (slow)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from engine.parallel.groups import RankPool

    rows: list[Row] = []
    for w in args.world_sizes:
        with RankPool(w, backend=args.backend, timeout_s=3600) as pool:
            for context in args.contexts:
                for batch in args.batches:
                    rows.append(measure(pool, args, context, batch))
                    print(f"done {rows[-1]}", file=sys.stderr, flush=True)
    print_table(rows, args)
    if args.json:
        head = [r for r in rows if r.world_size == args.world_sizes[0] and r.batch == min(args.batches)]
        head = max(head, key=lambda r: r.context)
        args.json.write_text(json.dumps({
            "headline": {"metric": f"tpot_dcp_over_tp_W{head.world_size}_ctx{head.context}_batch{head.batch}",
                         "value": round(head.dcp_over_tp, 3), "goal": None},
            "model": args.model, "kernels": args.kernels, "backend": args.backend, "device": args.device,
            "steps": args.steps,
            "rows": [asdict(r) | {"dcp_over_tp": round(r.dcp_over_tp, 3)} for r in rows],
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
