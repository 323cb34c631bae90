"""Token-sharded vs head-sharded W-rank prefill: attention-module time and end-to-end TTFT, side by side.

Real rank processes (gloo on CPU, one torch thread each, pinned round-robin; or `--backend nccl --device cuda`,
one GPU per rank, model, weights, caches and every intermediate on that GPU) run
`engine.parallel.prefill.parallel_prefill` on each rank's shard of the kimi-k3.1-mini model (engine/model/shards.py:
its heads, experts and output rows) for one prompt of each length, in
both modes, alternating in one run so machine noise hits both. Reported per (W, prompt): the attention
module (indexer + sparse MLA incl. cache dequantisation; slowest rank) and the whole prefill step (slowest
rank, = TTFT without HTTP), with the head/token ratios. The append case prefills --prefix tokens first
(not timed), then times --append new tokens on top of the cached prefix in each mode.

    python benchmarks/prefill.py [--world-sizes 2 4] [--lengths 4096 16384 32768] [--json PATH]
    python benchmarks/prefill.py --backend nccl --device cuda --world-sizes 2 --lengths 16384 32768 65536
    python benchmarks/prefill.py --kernels fast --backend nccl --device cuda --world-sizes 1 2 ...

`--kernels fast` runs engine/parallel/fast_prefill.py instead (bf16, the Triton indexer and sparse MLA reading
the packed rows, fla-core's chunk KDA on CUDA, compiled segments) on the same shard into each rank's row pool (on
CPU the kernels run under the Triton interpreter, which this script turns on: slow, keep the lengths small).

Headline: attention-module speed-up of token-sharded over head-sharded at W=2, 16K (goal >= 1.6x).
`--model` takes a preset name or a ModelConfig JSON file. On CUDA, times are taken after a device synchronise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Row:
    world_size: int
    case: str
    new_tokens: int
    cached_tokens: int
    head_attention_s: float
    token_attention_s: float
    head_total_s: float
    token_total_s: float
    exchange_mib_token: float
    exchange_mib_head: float

    @property
    def attention_speedup(self) -> float:
        return self.head_attention_s / self.token_attention_s

    @property
    def ttft_speedup(self) -> float:
        return self.head_total_s / self.token_total_s


def rank_run(ctx, preset: str, new_tokens: int, prefix: int, seed: int, modes: list[str],
             kernels: str = "reference") -> dict:
    if kernels == "fast":
        return fast_rank_run(ctx, preset, new_tokens, prefix, seed, modes)
    import torch

    from engine.model.config import preset_or_file
    from engine.model.numerics import device_scope
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.kda_shard import rank_cache
    from engine.parallel.prefill import PrefillBatch, parallel_prefill
    from engine.parallel.tp import apply_tp

    torch.manual_seed(seed)
    cfg = preset_or_file(preset)
    model = apply_tp(build_model(cfg, device=ctx.device, shard=ShardSpec(ctx.world_size, ctx.rank)), ctx)
    tokens = torch.randint(0, 256, (prefix + new_tokens,), generator=torch.Generator().manual_seed(seed))
    with device_scope(ctx.device):  # CPU: no-op
        base = rank_cache(cfg, prefix + new_tokens, ctx.world_size, ctx.rank)
    if prefix:
        parallel_prefill(ctx, model, PrefillBatch((tokens[:prefix],), (0,)), [base], "token")
    out = {}
    for mode in modes:
        cache = copy.deepcopy(base)
        res = parallel_prefill(ctx, model, PrefillBatch((tokens[prefix:],), (prefix,)), [cache], mode)
        out[mode] = {"attention_s": res.stats.attention_s, "total_s": res.stats.total_s,
                     "bytes": res.stats.exchange_bytes, "first_token": int(res.logits[0].argmax())}
    return out


_FAST: dict = {}
"""Per rank process: the fast prefiller of (model, world size), built once (weights, bf16 copies, compiled
segments) and reused by every row."""


def fast_rank_run(ctx, preset: str, new_tokens: int, prefix: int, seed: int, modes: list[str]) -> dict:
    """The fast SPMD prefill (engine/parallel/fast_prefill.py) into the rank's row pool on its device: the prefix
    token-sharded (untimed), then the new tokens in each mode from the same rows (restored between modes)."""
    import torch

    from engine.layout import plan_layout
    from engine.model.config import preset_or_file
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.fast_prefill import TPFastPrefiller
    from engine.parallel.fast_tp import TPFastDecoder

    cfg = preset_or_file(preset)
    key = (preset, ctx.world_size)
    if key not in _FAST:
        torch.manual_seed(seed)
        model = build_model(cfg, device=ctx.device, shard=ShardSpec(ctx.world_size, ctx.rank))
        layout = plan_layout(cfg, tp_size=ctx.world_size)
        decoder = TPFastDecoder(model, layout, ctx, compile=ctx.device.type == "cuda")
        _FAST.clear()
        _FAST[key] = (layout, TPFastPrefiller(decoder))
    layout, prefiller = _FAST[key]
    # the request's rows as a node's pool holds them (RowPool itself takes the reference engine's fp32 KDA state
    # only; the fast kernels also read bf16 conv state): attention rows first, then the KDA rows, zeroed
    num_attn, num_kda = layout.rows_per_request(prefix + new_tokens)
    buffer = torch.zeros(num_attn + num_kda, layout.row_bytes, dtype=torch.uint8, device=ctx.device)
    attn, kda = list(range(num_attn)), list(range(num_attn, num_attn + num_kda))
    tokens = torch.randint(0, 256, (prefix + new_tokens,), generator=torch.Generator().manual_seed(seed))
    if prefix:
        prefiller.prefill(buffer, tokens[:prefix], attn, kda, 0, "token")
    saved = buffer.clone()
    out = {}
    for mode in modes:
        buffer.copy_(saved)
        res = prefiller.prefill(buffer, tokens[prefix:], attn, kda, prefix, mode)
        out[mode] = {"attention_s": res.stats.attention_s, "total_s": res.stats.total_s,
                     "bytes": res.stats.exchange_bytes, "first_token": int(res.logits[0].argmax())}
    del buffer, saved
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def measure(pool, args, case: str, new_tokens: int, prefix: int) -> Row:
    results = pool.run(rank_run, args.model, new_tokens, prefix, args.seed, ["head", "token"], args.kernels)
    if len({r[m]["first_token"] for r in results for m in ("head", "token")}) != 1:
        raise SystemExit(f"first token differs between modes for {case} {new_tokens}")
    worst = {m: {k: max(r[m][k] for r in results) for k in ("attention_s", "total_s", "bytes")}
             for m in ("head", "token")}
    return Row(pool.world_size, case, new_tokens, prefix, worst["head"]["attention_s"],
               worst["token"]["attention_s"], worst["head"]["total_s"], worst["token"]["total_s"],
               worst["token"]["bytes"] / 2**20, worst["head"]["bytes"] / 2**20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi-k3.1-mini")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--prefix", type=int, default=16384, help="cached tokens of the append case (0: skip)")
    parser.add_argument("--append", type=int, default=2048, help="new tokens of the append case")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU ranks) or nccl (one GPU per rank)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs --backend nccl")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed prompt of this many tokens first (default: 2048 on cuda, 0 on cpu)")
    parser.add_argument("--kernels", default="reference", choices=["reference", "fast"],
                        help="reference: engine/parallel/prefill.py (fp32); fast: engine/parallel/fast_prefill.py "
                             "(bf16, Triton kernels, compiled segments on CUDA) into row pools")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if (args.device == "cuda") != (args.backend == "nccl"):
        parser.error("--device cuda goes with --backend nccl (one GPU per rank), --device cpu with gloo")
    if args.warmup is None:
        args.warmup = 2048 if args.device == "cuda" else 0
    if args.kernels == "fast" and args.device == "cpu":  # the Triton kernels on CPU: the interpreter (slow)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from engine.parallel.groups import RankPool

    rows: list[Row] = []
    for w in args.world_sizes:
        with RankPool(w, backend=args.backend, timeout_s=3600) as pool:
            if args.warmup:  # untimed: CUDA context, cuBLAS handles and NCCL communicators before the first row
                measure(pool, args, "warmup", args.warmup, 0)
            for length in args.lengths:
                rows.append(measure(pool, args, "prompt", length, 0))
                print(f"done {rows[-1]}", file=sys.stderr, flush=True)
            if args.prefix:
                rows.append(measure(pool, args, "append", args.append, args.prefix))
                print(f"done {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{args.model}, {args.kernels} kernels, {args.backend} ranks on {args.device}; times are the slowest "
          "rank's, seconds")
    print(f"{'W':>2} {'case':<7} {'new':>6} {'cached':>6} {'attn head':>9} {'attn token':>10} {'attn x':>6} "
          f"{'TTFT head':>9} {'TTFT token':>10} {'TTFT x':>6} {'MiB token':>9} {'MiB head':>8}")
    for r in rows:
        print(f"{r.world_size:>2} {r.case:<7} {r.new_tokens:>6} {r.cached_tokens:>6} {r.head_attention_s:>9.2f} "
              f"{r.token_attention_s:>10.2f} {r.attention_speedup:>6.2f} {r.head_total_s:>9.2f} "
              f"{r.token_total_s:>10.2f} {r.ttft_speedup:>6.2f} {r.exchange_mib_token:>9.1f} "
              f"{r.exchange_mib_head:>8.1f}")
    head = [r for r in rows if (r.world_size, r.case, r.new_tokens) == (2, "prompt", 16384)]
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "prefill_attention_speedup_token_over_head_W2_16K",
                         "value": head[0].attention_speedup if head else None, "goal": 1.6},
            "ttft_speedup_W2_16K": head[0].ttft_speedup if head else None,
            "model": args.model, "kernels": args.kernels, "backend": args.backend, "device": args.device,
            "rows": [dict(asdict(r), attention_speedup=r.attention_speedup, ttft_speedup=r.ttft_speedup)
                     for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
