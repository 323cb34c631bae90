"""Functions the test rank processes run (importable by spawned children)."""

from __future__ import annotations

import torch

from engine.parallel.dcp_attention import dcp_combine, partial_attention
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.dcp_merge import compact_merge, generic_merge
from engine.parallel.groups import ParallelContext


def merge_case(ctx: ParallelContext, scores: torch.Tensor, k: int, interleave: int, method: str,
               key_bits: int | None) -> dict:
    layout = DCPLayout(ctx.world_size, interleave)
    local = layout.shard(scores, ctx.rank, dim=1)
    if method == "compact":
        res = compact_merge(ctx, local, k, layout, key_bits=key_bits or 32)
    else:
        res = generic_merge(ctx, local, k, layout)
    gids = layout.global_ids(ctx.rank, local.shape[1])
    own = [gids[row[row >= 0]].tolist() for row in res.local_ids]
    return {"own": own, "counts": res.counts, "fallback": res.num_fallback_rows, "bytes": res.bytes_sent}


def attention_case(ctx: ParallelContext, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   selected: torch.Tensor, interleave: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank attends over its owned selected tokens, then the LSE merge."""
    layout = DCPLayout(ctx.world_size, interleave)
    owned = (layout.owner(selected.clamp(min=0)) == ctx.rank) & (selected >= 0)
    ids = torch.where(owned, selected, 0)
    k_sel = keys.gather(1, ids[..., None].expand(-1, -1, keys.shape[2]))
    v_sel = values.gather(1, ids[..., None].expand(-1, -1, values.shape[2]))
    merged = dcp_combine(ctx, partial_attention(q, k_sel, v_sel, owned, scale))
    return merged.out, merged.lse


def rank_model(ctx: ParallelContext, cfg):  # noqa: ANN001, ANN201
    """This rank's shard of the seeded model (engine/model/shards.py), its MoE expert-parallel."""
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.tp import apply_tp

    return apply_tp(build_model(cfg, shard=ShardSpec(ctx.world_size, ctx.rank)), ctx)


def shard_tensors(ctx: ParallelContext, cfg) -> dict:  # noqa: ANN001
    """This rank's parameters as its node builds them (the expert-parallel wrapper keeps the same tensors)."""
    model = rank_model(ctx, cfg)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def moe_case(ctx: ParallelContext, cfg, num_rows: int) -> dict:  # noqa: ANN001
    """Layer 1's expert-parallel MoE on the same rows on every rank, through `forward` (all-to-alls) and
    `forward_replicated`, counting the (row, slot) pairs this rank's experts run in each."""
    model = rank_model(ctx, cfg)
    moe = model.layers[1].ffn
    x = torch.randn(num_rows, cfg.d_model, generator=torch.Generator().manual_seed(11))
    counted = {"pairs": 0}
    expert = moe.expert

    def counting(e, z):  # noqa: ANN001, ANN202
        counted["pairs"] += int((moe._ids == e).sum())
        return expert(e, z)

    moe.expert = counting
    out = {}
    for name in ("forward", "forward_replicated"):
        moe._ids, _ = moe.route(x)
        counted["pairs"] = 0
        out[name] = (getattr(moe, name)(x, num_rows), counted["pairs"])
    return out


def prefill_case(ctx: ParallelContext, cfg, prompts: list[torch.Tensor], prefix_lens: list[int], mode: str,
                 capacity: int, all_logits: bool = False) -> dict:
    """Build this rank's shard of the seeded model, prefill each prompt's prefix (if any) then the rest in one
    batch."""
    from engine.parallel.kda_shard import rank_cache
    from engine.parallel.prefill import PrefillBatch, parallel_prefill

    model = rank_model(ctx, cfg)
    caches = [rank_cache(cfg, capacity, ctx.world_size, ctx.rank) for _ in prompts]
    with_prefix = [b for b, n in enumerate(prefix_lens) if n]
    if with_prefix:
        first = PrefillBatch(tuple(prompts[b][: prefix_lens[b]] for b in with_prefix), tuple(0 for _ in with_prefix))
        parallel_prefill(ctx, model, first, [caches[b] for b in with_prefix], mode)
    batch = PrefillBatch(tuple(p[n:] for p, n in zip(prompts, prefix_lens)), tuple(prefix_lens))
    res = parallel_prefill(ctx, model, batch, caches, mode, record_selections=True, all_logits=all_logits)
    return {"logits": res.logits, "caches": caches, "stats": res.stats}


def decode_case(ctx: ParallelContext, cfg, prompts: list[torch.Tensor], steps: int, mode: str, interleave: int,
                merge: str, attention: str = "exact") -> dict:
    """Prefill each prompt with the whole model into one full cache, shard the cache (DCP or TP), decode `steps`
    greedy tokens with this rank's shard of the model."""
    from engine.model.state import LocalSequenceCache
    from engine.model.weights import build_model
    from engine.parallel.dcp_cache import DCPRankCache
    from engine.parallel.dcp_decode import parallel_decode
    from engine.parallel.kda_shard import shard_state

    model = build_model(cfg)
    capacity = max(p.numel() for p in prompts) + steps + 1
    layout = DCPLayout(ctx.world_size, interleave)
    caches, tokens = [], []
    for p in prompts:
        full = LocalSequenceCache(cfg, capacity)
        tokens.append([int(model.prefill(p, full, 0)[0].argmax())])
        if mode == "dcp":
            caches.append(DCPRankCache.from_full(cfg, full, p.numel(), capacity, layout, ctx.rank))
        else:
            full.kda = [shard_state(cfg, s, ctx.world_size, ctx.rank) for s in full.kda]
            caches.append(full)
    model = rank_model(ctx, cfg)
    positions = [p.numel() for p in prompts]
    merge_bytes, fallbacks = 0, 0
    for _ in range(steps):
        res = parallel_decode(ctx, model, torch.tensor([t[-1] for t in tokens]), positions, caches, mode, layout,
                              merge, attention)
        merge_bytes += res.stats.merge_bytes
        fallbacks += res.stats.merge_fallback_rows
        for b, tok in enumerate(res.logits.argmax(-1).tolist()):
            tokens[b].append(tok)
        positions = [p + 1 for p in positions]
    return {"tokens": tokens, "merge_bytes": merge_bytes, "fallbacks": fallbacks, "last_logits": res.logits}


def fail_on_rank_one(ctx: ParallelContext) -> int:
    if ctx.rank == 1:
        raise ValueError("rank one fails on purpose")
    return ctx.rank


def exchange_case(ctx: ParallelContext) -> list[torch.Tensor]:
    """Uneven all_to_all: rank r sends r + d rows (value 100 r + d) to rank d."""
    from engine.parallel.comm import all_to_all_list

    chunks = [torch.full((ctx.rank + d, 3), float(100 * ctx.rank + d)) for d in range(ctx.world_size)]
    return all_to_all_list(ctx, chunks)
