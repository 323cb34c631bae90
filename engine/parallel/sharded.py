"""Running a rank's shard of the model (engine/model/shards.py) where every rank holds the same rows (decode).

A rank holds the per-head weights of its heads and d_model/W output rows of each output projection wo. Each
value is computed by the single rank's ops on the single rank's inputs, so results stay bitwise:
- `all_heads`: the local heads' tensor [R, H/W, ...] of every rank, all-gathered into [R, H, ...] (head order).
- `output_rows`: the local heads' gated values [R, H/W * v] are all-gathered into every head's [R, H * v]; each
  rank computes its d_model/W output features with full-length dot products (wo's own rows) and one all-gather
  of [R, d_model/W] assembles the output [R, d_model] (no partial sum crosses ranks).
With a whole model on one rank both are the plain ops (the gathers return their input).
"""

from __future__ import annotations

import torch

from engine.model.mla import MLA, MLAProjection
from engine.parallel.comm import all_gather_stack
from engine.parallel.groups import ParallelContext


def check_shard(ctx: ParallelContext, model) -> None:  # type: ignore[no-untyped-def]
    """The model must be this rank's shard of `ctx`'s group (engine/model/shards.py)."""
    spec = model.shard
    if (spec.world_size, spec.rank) != (ctx.world_size, ctx.rank):
        raise ValueError(f"rank {ctx.rank} of {ctx.world_size} runs a model built for shard {spec.rank} of "
                         f"{spec.world_size}: build it with ShardSpec({ctx.world_size}, {ctx.rank})")


def all_heads(ctx: ParallelContext, local: torch.Tensor) -> torch.Tensor:
    """[R, h, ...] of the local heads on every rank -> [R, W*h, ...] (rank r's heads at r*h)."""
    if ctx.is_single:
        return local
    gathered = all_gather_stack(ctx, local)                                   # [W, R, h, ...]
    rows, heads = local.shape[0], local.shape[1]
    return gathered.transpose(0, 1).reshape(rows, ctx.world_size * heads, *local.shape[2:])


def output_rows(ctx: ParallelContext, wo: torch.nn.Module, local_values: torch.Tensor) -> torch.Tensor:
    """Gated values of the local heads [R, h*v] -> the projected output [R, d_model] on every rank."""
    if ctx.is_single:
        return wo(local_values)
    every_head = all_heads(ctx, local_values)                                 # [R, H*v]
    mine = wo(every_head)                                                     # [R, d_model / W]
    return all_heads(ctx, mine)


def project_all_heads(ctx: ParallelContext, mla: MLA, h: torch.Tensor, positions: torch.Tensor) -> MLAProjection:
    """`MLA.project` of rows every rank holds, with the queries of every head (gathered from their ranks) and the
    gate of the local heads (what `mla_output` takes)."""
    pos = mla.row_positions(h.shape[0], positions)
    qr = mla.query_latent(h)
    latent_bytes, key_bytes, key_scale = mla.cache_rows(h, pos)
    return MLAProjection(q_absorbed=all_heads(ctx, mla.head_queries(qr, pos)), latent_bytes=latent_bytes,
                         index_queries=mla.index_queries(qr, h, pos), index_key_bytes=key_bytes,
                         index_key_scale=key_scale, gate=mla.gate(h))


def mla_output(ctx: ParallelContext, mla: MLA, o_latent: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o^lat [R, H, kv_lora] of every head (rows every rank holds) -> [R, d_model]: W_UV and the gate on the local
    heads, then `output_rows`."""
    local = o_latent[:, mla.head_lo:mla.head_lo + mla.num_local_heads]
    return output_rows(ctx, mla.wo, mla.head_output(local, gate))
