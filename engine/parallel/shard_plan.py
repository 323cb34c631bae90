"""Which new prefill tokens each rank owns: the causal-balanced zigzag split and the contiguous split.

Zigzag (token-sharded prefill): each request's T new tokens are cut into 2W pieces of ceil(T / 2W) tokens
(the last ones may be short or empty); rank r owns pieces r and 2W-1-r, so early (cheap) and late (costly)
queries pair up and every rank's causal attention work is about equal (vLLM PCP's split). Contiguous (the
head-sharded baseline's token-local work): rank r owns one run of ceil(T / W) rows rounded up to 16.
A plan lists, per request, the rank's owned offsets (0..T-1, ascending); every rank can build every other
rank's plan, which is how gathers are put back in global order without sending indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.numerics import ROW_BLOCK, round_up


def zigzag_offsets(num_tokens: int, world_size: int, rank: int) -> torch.Tensor:
    """Offsets of pieces r and 2W-1-r of a T-token request (ascending)."""
    chunk = -(-num_tokens // (2 * world_size)) if num_tokens else 0
    parts = []
    for piece in (rank, 2 * world_size - 1 - rank):
        lo, hi = min(piece * chunk, num_tokens), min((piece + 1) * chunk, num_tokens)
        parts.append(torch.arange(lo, hi, dtype=torch.int64))
    return torch.cat(parts)


def contiguous_offsets(num_tokens: int, world_size: int, rank: int) -> torch.Tensor:
    """One aligned run of ceil(T / W) rows (rounded up to the row block) per rank."""
    size = round_up(-(-num_tokens // world_size), ROW_BLOCK) if num_tokens else 0
    lo, hi = min(rank * size, num_tokens), min((rank + 1) * size, num_tokens)
    return torch.arange(lo, hi, dtype=torch.int64)


@dataclass(frozen=True)
class ShardPlan:
    """One rank's owned tokens of a batch of requests (new tokens only)."""

    offsets: tuple[torch.Tensor, ...]
    """Per request: owned offsets into its new tokens, ascending."""

    @property
    def num_rows(self) -> int:
        return sum(int(o.numel()) for o in self.offsets)

    def row_slices(self) -> list[slice]:
        """Where each request's owned rows sit in the rank's concatenated row list."""
        out, at = [], 0
        for o in self.offsets:
            out.append(slice(at, at + int(o.numel())))
            at += int(o.numel())
        return out


def plan(lengths: list[int], world_size: int, rank: int, kind: str = "zigzag") -> ShardPlan:
    split = zigzag_offsets if kind == "zigzag" else contiguous_offsets
    return ShardPlan(tuple(split(t, world_size, rank) for t in lengths))


def all_plans(lengths: list[int], world_size: int, kind: str = "zigzag") -> list[ShardPlan]:
    return [plan(lengths, world_size, r, kind) for r in range(world_size)]


def scatter_to_global(parts: list[torch.Tensor], plans: list[ShardPlan], lengths: list[int]) -> list[torch.Tensor]:
    """Rows gathered from every rank (rank order, each in its plan's row order) -> per request [T, ...] in
    global order."""
    tail = tuple(parts[0].shape[1:])
    out = [parts[0].new_zeros((t,) + tail) for t in lengths]
    for part, pl in zip(parts, plans):
        for b, (offs, rows) in enumerate(zip(pl.offsets, pl.row_slices())):
            out[b][offs] = part[rows]
    return out
