"""W-rank decode step over a rank's shard of the model: DCP (cache split by token) or TP (whole cache on every rank).

SPMD: every rank calls `parallel_decode(ctx, model, token_ids, positions, caches, mode)` with the same batch of
B requests (one new token each); `model` is this rank's shard (engine/model/shards.py, MoE expert-parallel).
Token-wise work on replicated weights (norms, latent and indexer projections, router, logits) runs on all B rows
on every rank (the rows are identical everywhere, so every rank ends the step with identical logits and needs no
broadcast). Per-head work runs on the rank's heads (engine/parallel/sharded.py): its heads' queries are
all-gathered into every head's; W_UV, the gate and KDA (its heads' state, per-head work, bitwise as on one rank)
run on its heads; the gated values are all-gathered, the rank computes its rows of the output projection, and
one all-gather of the output features restores [B, d_model].

MLA + DSA attention:
- dcp: each rank holds only its owned tokens (`DCPRankCache`). Every rank has the broadcast query (computed
  locally from the replicated rows), scores its own index keys (exact, engine.model.indexer.index_scores),
  the DCP merge (`dcp_merge.compact_merge`, or `generic_merge`) gives the exact global top-k. Then, by
  `attention`: `exact` (default) all-gathers the selected FP8 latents with their positions and every rank
  runs the single-rank sparse MLA over them in position order, so the logits equal one rank's bit for bit
  (what makes served log-probs reproducible on any pool); `lse`: each rank attends over its owned selected
  tokens and the LSE merge combines the partial outputs in rank order (moves [H, d_c] per rank instead of
  the selected latents; equal within fp32 rounding).
- tp: every rank holds the whole cache (replicated latent) and runs the single-rank indexer and sparse MLA
  for all heads (`KimiModel.decode_attend`): splitting heads changes the score GEMM's shape and its last bits.
World size 1 in either mode is the plain single-rank decode on the same code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.model.indexer import index_keys_to_float, index_scores
from engine.model.kda import causal_conv_step, kda_recurrent_step, l2_normalize
from engine.model.mla import MLA, attention_topk, sparse_mla_gathered
from engine.model.model import KimiModel
from engine.model.numerics import device_scope, pad_rows
from engine.model.state import KDAState
from engine.parallel.comm import all_gather_varlen
from engine.parallel.dcp_attention import (
    PartialAttention,
    dcp_combine,
    partial_attention,
)
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.dcp_merge import MergeResult, compact_merge, generic_merge
from engine.parallel.groups import ParallelContext
from engine.parallel.sharded import check_shard, mla_output, output_rows, project_all_heads
from engine.parallel.tp import replicated_rows_ffn

MODES = ("dcp", "tp")
ATTENTION = ("exact", "lse")
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
                    caches: list, mode: str = "dcp", layout: DCPLayout | None = None, merge: str = "compact",
                    attention: str = "exact") -> DecodeResult:
    """One decode step for B requests: token_ids [B] at `positions` -> next-token logits [B, V].

    `attention` (DCP): `exact` gathers the selected latents so every rank attends as one rank does (logits
    bit-identical to the single-rank decode); `lse` attends over each rank's own selected tokens and merges the
    partial outputs by log-sum-exp (less data moved; equal within fp32 rounding)."""
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
    if attention not in ATTENTION:
        raise ValueError(f"DCP attention must be one of {ATTENTION}, got {attention!r}")
    check_shard(ctx, model)
    layout = layout or DCPLayout(ctx.world_size)
    stats = DecodeStats()
    batch = token_ids.shape[0]
    step = _Step(ctx, model, positions, caches, mode, layout, merge, attention, stats)
    with torch.no_grad(), device_scope(ctx.device):
        x = pad_rows(model.embed[token_ids.to(ctx.device)])
        x = model.run_layers(x, batch, step.mla, lambda kda, h, i: _kda(ctx, model, kda, h, caches, i),
                             replicated_rows_ffn)
        return DecodeResult(logits=model.logits(x[:batch]), stats=stats)


@dataclass
class _Step:
    ctx: ParallelContext
    model: KimiModel
    positions: list[int]
    caches: list
    mode: str
    layout: DCPLayout
    merge: str
    attention: str
    stats: DecodeStats

    @property
    def topk(self) -> int:
        """Keys each query attends to (all of them for a dense MLA)."""
        return attention_topk(self.model.cfg, max(self.positions) + 1)

    def mla(self, mla: MLA, h: torch.Tensor, idx: int) -> torch.Tensor:
        start = time.perf_counter()
        proj = project_all_heads(self.ctx, mla, h, torch.tensor(self.positions))
        if self.mode == "tp":  # every rank holds the whole cache: attend exactly as one rank does
            o_lat = self.model.decode_attend(mla, proj, h.shape[0], self.positions, self.caches, idx)
            self.stats.attention_s += time.perf_counter() - start
            return mla_output(self.ctx, mla, o_lat, proj.gate)
        cfg = self.model.cfg
        batch = len(self.positions)
        for b, (pos, cache) in enumerate(zip(self.positions, self.caches)):
            cache.write_attention(idx, pos, proj.latent_bytes[b:b + 1], proj.index_key_bytes[b:b + 1],
                                  proj.index_key_scale[b:b + 1])
        owned = [c.read_owned(idx, pos + 1) for c, pos in zip(self.caches, self.positions)]
        merged = self._select(proj, owned)
        if self.attention == "exact":
            o_lat = self._gathered_attention(mla, proj, owned, merged)
        else:
            o_lat = dcp_combine(self.ctx, self._partial(mla, proj, owned, merged)).out     # [B, H, kv_lora]
        self.stats.attention_s += time.perf_counter() - start
        out = h.new_zeros(h.shape[0], cfg.num_heads, cfg.kv_lora_rank)
        out[:batch] = o_lat
        return mla_output(self.ctx, mla, out, proj.gate)

    def _select(self, proj, owned: list) -> MergeResult:  # type: ignore[no-untyped-def]
        """Score this rank's owned index keys; the exact global top-k merge says which of them are selected."""
        scores = torch.full((len(self.positions), max(1, max(o.latent.shape[0] for o in owned))), NEG_INF)
        for b, rows in enumerate(owned):
            n = rows.latent.shape[0]
            if n:
                scores[b, :n] = index_scores(proj.index_queries.q[b:b + 1], proj.index_queries.weights[b:b + 1],
                                             index_keys_to_float(rows.index_key, self.model.cfg.index_key_dtype),
                                             rows.index_scale)[0]
        merged = (compact_merge if self.merge == "compact" else generic_merge)(self.ctx, scores, self.topk,
                                                                               self.layout)
        self.stats.merge_bytes += merged.bytes_sent
        self.stats.merge_fallback_rows += merged.num_fallback_rows
        self.stats.selections.append([])
        return merged

    def _gathered_attention(self, mla: MLA, proj, owned: list, merged: MergeResult) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Every rank receives every selected latent (FP8 bytes and global position), orders them by position as
        `select_topk` does, and runs the single-rank sparse MLA on them: the same ops on the same inputs."""
        cfg, ctx = self.model.cfg, self.ctx
        tags, rows = [], []
        for b, own in enumerate(owned):
            ids = merged.local_ids[b][merged.local_ids[b] >= 0]
            gids = self.layout.global_ids(ctx.rank, own.latent.shape[0])[ids]
            self.stats.selections[-1].append(gids)
            tags.append(torch.stack([torch.full_like(gids, b), gids], dim=1))
            rows.append(own.latent[ids])
        mine_tags, mine_rows = torch.cat(tags), torch.cat(rows)
        self.stats.merge_bytes += (mine_tags.numel() * 8 + mine_rows.numel()) * (ctx.world_size - 1)
        all_tags = torch.cat(all_gather_varlen(ctx, mine_tags))
        all_rows = torch.cat(all_gather_varlen(ctx, mine_rows))
        k = self.topk
        selected = torch.full((len(owned), k), -1, dtype=torch.int64)
        latent = torch.zeros(len(owned), k, mine_rows.shape[1], dtype=mine_rows.dtype)
        for b in range(len(owned)):
            mine = (all_tags[:, 0] == b).nonzero().squeeze(1)
            order = mine[torch.argsort(all_tags[mine, 1])]
            selected[b, : order.numel()] = all_tags[order, 1]
            latent[b, : order.numel()] = all_rows[order]
        gathered = mla.decode_latent(latent)                                      # [B, k, C]
        return sparse_mla_gathered(proj.q_absorbed[: len(owned)], gathered, selected, mla.softmax_scale,
                                   cfg.kv_lora_rank)

    def _partial(self, mla: MLA, proj, owned: list, merged: MergeResult) -> PartialAttention:  # type: ignore[no-untyped-def]
        cfg = self.model.cfg
        k = self.topk
        keys = torch.zeros(len(self.positions), k, cfg.latent_dim)
        mask = merged.local_ids >= 0
        for b, rows in enumerate(owned):
            ids = merged.local_ids[b][mask[b]]
            keys[b, : ids.numel()] = mla.decode_latent(rows.latent[ids])
            self.stats.selections[-1].append(self.layout.global_ids(self.ctx.rank, rows.latent.shape[0])[ids])
        q = proj.q_absorbed[: len(self.positions)]
        return partial_attention(q, keys, keys[..., : cfg.kv_lora_rank], mask, mla.softmax_scale)


def _kda(ctx: ParallelContext, model: KimiModel, kda, h: torch.Tensor, caches: list, idx: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One KDA layer on the rank's heads (its shard's projections, state and conv taps), then `output_rows`."""
    batch = len(caches)
    proj = kda.project(h)
    per, d = kda.num_heads, kda.head_dim
    states = [c.read_kda(idx) for c in caches]
    conv_out, conv_state = causal_conv_step(proj.qkv[:batch], torch.stack([s.conv for s in states]),
                                            kda.conv_weight)
    q, k, v = conv_out.view(-1, 3, per, d).unbind(1)
    q = l2_normalize(q) * d**-0.5
    o, recurrent = kda_recurrent_step(q, l2_normalize(k), v, proj.g[:batch], proj.beta[:batch],
                                      torch.stack([s.recurrent for s in states]))
    for b, cache in enumerate(caches):
        cache.write_kda(idx, KDAState(recurrent[b], conv_state[b]))
    out = h.new_zeros(h.shape[0], per, d)
    out[:batch] = o
    return output_rows(ctx, kda.wo, kda.head_output(out, proj.gate_out))
