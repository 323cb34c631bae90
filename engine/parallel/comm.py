"""Thin collective wrappers over a ParallelContext: data movement only (all_gather, all_to_all).

Determinism rule of every parallel path (move data, never partial sums): nothing here sums across ranks:
every rank receives the other ranks' data and reduces it itself in a fixed order. With world_size == 1
each wrapper returns its input unchanged (shaped as a 1-rank gather), so callers need no branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel.groups import ParallelContext


def all_gather_stack(ctx: ParallelContext, tensor: torch.Tensor) -> torch.Tensor:
    """[...] on every rank -> [W, ...] in rank order (same shape and dtype on every rank)."""
    tensor = tensor.contiguous()
    if ctx.is_single:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(out, tensor, group=ctx.group)
    return torch.stack(out)


def all_gather_varlen(ctx: ParallelContext, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Rows of different counts per rank along dim 0 -> the list of every rank's tensor, rank order."""
    if ctx.is_single:
        return [tensor]
    count = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)  # NCCL: sizes on the GPU too
    sizes = all_gather_stack(ctx, count)[:, 0].tolist()
    longest = max(sizes)
    padded = torch.zeros((longest,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    gathered = all_gather_stack(ctx, padded)
    return [gathered[r, : sizes[r]] for r in range(ctx.world_size)]


def all_to_all_list(ctx: ParallelContext, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send chunks[r] to rank r; return what every rank sent to this one, in rank order.

    Chunk shapes may differ per destination along dim 0 (the trailing dims must agree); the receive
    sizes are exchanged first (one all_gather), then one all_to_all_single moves the chunks padded to the
    longest (gloo implements only the single-tensor form on every torch version we run).
    """
    if ctx.is_single:
        return [chunks[0]]
    assert len(chunks) == ctx.world_size
    send_sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64, device=chunks[0].device)
    sizes = all_gather_stack(ctx, send_sizes)                                 # [src, dst]
    recv_sizes = sizes[:, ctx.rank].tolist()
    longest = int(sizes.max())
    tail = tuple(chunks[0].shape[1:])
    send = torch.zeros((ctx.world_size * longest,) + tail, dtype=chunks[0].dtype, device=chunks[0].device)
    for r, c in enumerate(chunks):
        send[r * longest: r * longest + c.shape[0]] = c
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ctx.group)
    return [recv[r * longest: r * longest + recv_sizes[r]] for r in range(ctx.world_size)]
