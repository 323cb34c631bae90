"""W-rank decode step over the model's pieces: DCP (cache split by token) or TP (heads split).

SPMD: every rank calls `parallel_decode(ctx, model, token_ids, positions, caches, mode)` with the same batch of
B requests (one new token each). Token-wise work (norms, projections, MoE, logits) runs on all B rows on every
rank with the full weights (B is small in decode; the rows are identical everywhere, so every rank ends the
step with identical logits and needs no broadcast). KDA heads are split in both modes: each rank steps its
own heads' state, and one all-gather of o restores all heads before the output projection.

MLA + DSA attention:
- dcp: each rank holds only its owned tokens (`DCPRankCache`). Every rank has the broadcast query (computed
  locally from the replicated rows), scores its own index keys (exact, engine.model.indexer.index_scores),
  the DCP merge (`dcp_merge.compact_merge`, or `generic_merge`) gives the exact global top-k, each rank
  attends over its owned selected tokens, and the LSE merge combines the partial outputs in rank order.
- tp: every rank holds the whole cache (replicated latent) and runs the indexer plus sparse MLA for its
  H/W heads; one all-gather of o^lat restores all heads.
World size 1 in either mode is the plain single-rank decode on the same code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.model.indexer import index_scores
from engine.model.kda import causal_conv_step, kda_recurrent_step, l2_normalize
from engine.model.mla import MLA, sparse_attention
from engine.model.model import KimiModel, dequantize_context
from engine.model.numerics import device_scope, fp8_to_float, pad_rows
from engine.model.state import KDAState
from engine.parallel.comm import all_gather_stack
from engine.parallel.dcp_attention import (
    PartialAttention,
    dcp_combine,
    partial_attention,
)
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.dcp_merge import compact_merge, generic_merge
from engine.parallel.groups import ParallelContext
from engine.parallel.kda_shard import head_range, qkv_channels

MODES = ("dcp", "tp")
NEG_INF = float("-inf")


@dataclass
class DecodeStats:
    merge_bytes: int = 0
    """DCP top-k merge payload bytes this rank sent (all MLA layers)."""
    merge_fallback_rows: int = 0
    """Rows that took the exact second merge round."""
    attention_s: float = 0.0
    selections: list[list[torch.Tensor]] = field(default_factory=list)
    """Per MLA layer, per request: the global positions this rank attended to (ascending)."""


@dataclass(frozen=True)
class DecodeResult:
    logits: torch.Tensor  # [B, V], identical on every rank
    stats: DecodeStats


def parallel_decode(ctx: ParallelContext, model: KimiModel, token_ids: torch.Tensor, positions: list[int],
                    caches: list, mode: str = "dcp", layout: DCPLayout | None = None, merge: str = "compact"
                    ) -> DecodeResult:
    """One decode step for B requests: token_ids [B] at `positions` -> next-token logits [B, V]."""
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
    layout = layout or DCPLayout(ctx.world_size)
    stats = DecodeStats()
    batch = token_ids.shape[0]
    with torch.no_grad(), device_scope(ctx.device):
        x = pad_rows(model.embed[token_ids.to(ctx.device)])
        x = model.run_layers(
            x, batch,
            lambda mla, h, i: _mla(ctx, model, mla, h, positions, caches, i, mode, layout, merge, stats),
            lambda kda, h, i: _kda(ctx, model, kda, h, caches, i),
        )
        return DecodeResult(logits=model.logits(x[:batch]), stats=stats)


def _mla(ctx: ParallelContext, model: KimiModel, mla: MLA, h: torch.Tensor, positions: list[int], caches: list,
         idx: int, mode: str, layout: DCPLayout, merge: str, stats: DecodeStats) -> torch.Tensor:
    proj = mla.project(h)
    batch = len(positions)
    for b, (pos, cache) in enumerate(zip(positions, caches)):
        cache.write_attention(idx, pos, proj.latent_bytes[b:b + 1], proj.index_key_bytes[b:b + 1],
                              proj.index_key_scale[b:b + 1])
    start = time.perf_counter()
    if mode == "dcp":
        part = _dcp_partial(ctx, model, mla, proj, positions, caches, idx, layout, merge, stats)
        o_lat = dcp_combine(ctx, part).out                                    # [B, H, kv_lora]
    else:
        o_lat = _tp_attention(ctx, model, mla, proj, positions, caches, idx)
    stats.attention_s += time.perf_counter() - start
    out = h.new_zeros(h.shape[0], model.cfg.num_heads, model.cfg.kv_lora_rank)
    out[:batch] = o_lat
    return mla.output(out, proj.gate)


def _dcp_partial(ctx: ParallelContext, model: KimiModel, mla: MLA, proj, positions: list[int],  # type: ignore[no-untyped-def]
                 caches: list, idx: int, layout: DCPLayout, merge: str, stats: DecodeStats) -> PartialAttention:
    cfg = model.cfg
    owned = [c.read_owned(idx, pos + 1) for c, pos in zip(caches, positions)]
    width = max(1, max(o.latent.shape[0] for o in owned))
    scores = torch.full((len(positions), width), NEG_INF)
    for b, rows in enumerate(owned):
        n = rows.latent.shape[0]
        if n:
            scores[b, :n] = index_scores(proj.index_queries.q[b:b + 1], proj.index_queries.weights[b:b + 1],
                                         fp8_to_float(rows.index_key), rows.index_scale)[0]
    merged = (compact_merge if merge == "compact" else generic_merge)(ctx, scores, cfg.index_topk, layout)
    stats.merge_bytes += merged.bytes_sent
    stats.merge_fallback_rows += merged.num_fallback_rows
    stats.selections.append([])
    k = cfg.index_topk
    keys = torch.zeros(len(positions), k, cfg.latent_dim)
    mask = merged.local_ids >= 0
    for b, rows in enumerate(owned):
        ids = merged.local_ids[b][mask[b]]
        keys[b, : ids.numel()] = fp8_to_float(rows.latent[ids]) * mla.latent_scale
        stats.selections[-1].append(layout.global_ids(ctx.rank, rows.latent.shape[0])[ids])
    q = proj.q_absorbed[: len(positions)]
    return partial_attention(q, keys, keys[..., : cfg.kv_lora_rank], mask, mla.softmax_scale)


def _tp_attention(ctx: ParallelContext, model: KimiModel, mla: MLA, proj, positions: list[int],  # type: ignore[no-untyped-def]
                  caches: list, idx: int) -> torch.Tensor:
    cfg = model.cfg
    if cfg.num_heads % ctx.world_size:
        raise ValueError(f"{cfg.num_heads} MLA heads do not split over {ctx.world_size} ranks")
    per = cfg.num_heads // ctx.world_size
    heads = slice(ctx.rank * per, (ctx.rank + 1) * per)
    outs = []
    for b, (pos, cache) in enumerate(zip(positions, caches)):
        cached = dequantize_context(cache.read_attention(idx, pos + 1), mla.latent_scale)
        iq = type(proj.index_queries)(q=proj.index_queries.q[b:b + 1], weights=proj.index_queries.weights[b:b + 1])
        outs.append(sparse_attention(proj.q_absorbed[b:b + 1, heads], iq, torch.tensor([pos]), cached,
                                     cfg.index_topk, mla.softmax_scale, cfg.kv_lora_rank))
    mine = torch.cat(outs)                                                    # [B, H/W, kv_lora]
    gathered = all_gather_stack(ctx, mine)                                    # [W, B, H/W, kv_lora]
    return gathered.permute(1, 0, 2, 3).reshape(len(positions), cfg.num_heads, cfg.kv_lora_rank)


def _kda(ctx: ParallelContext, model: KimiModel, kda, h: torch.Tensor, caches: list, idx: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cfg = model.cfg
    batch = len(caches)
    proj = kda.project(h)
    lo, hi = head_range(cfg, ctx.world_size, ctx.rank)
    per, d = hi - lo, cfg.kda_head_dim
    channels = qkv_channels(cfg, lo, hi)
    states = [c.read_kda(idx) for c in caches]
    conv_out, conv_state = causal_conv_step(proj.qkv[:batch, channels], torch.stack([s.conv for s in states]),
                                            kda.conv_weight[channels])
    q, k, v = conv_out.view(-1, 3, per, d).unbind(1)
    q = l2_normalize(q) * d**-0.5
    o, recurrent = kda_recurrent_step(q, l2_normalize(k), v, proj.g[:batch, lo:hi], proj.beta[:batch, lo:hi],
                                      torch.stack([s.recurrent for s in states]))
    for b, cache in enumerate(caches):
        cache.write_kda(idx, KDAState(recurrent[b], conv_state[b]))
    o_all = all_gather_stack(ctx, o).permute(1, 0, 2, 3).reshape(batch, cfg.kda_num_heads, d)
    out = h.new_zeros(h.shape[0], cfg.kda_num_heads, d)
    out[:batch] = o_all
    return kda.output(out, proj.gate_out)
