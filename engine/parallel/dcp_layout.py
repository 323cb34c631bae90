"""DCP token ownership: which rank keeps which token of a request's cache, and at which local index.

Tokens are owned in aligned runs of `interleave` tokens (I): token s lives on rank (s // I) % W at local
index (s // (I*W)) * I + s % I. I = 1 is vLLM's default token interleave; I = the cache sub-block size keeps
every owned run one contiguous range of a packed prefill row, so a decode rank reads its share of a
prefill row with one descriptor per owned sub-block (LAYOUT.md, "DCP destinations"). Global ids of a
rank's local tokens increase with the local index: local order == global order within a rank, which is
what makes a per-rank stable top-k agree with the global tie-break (ties go to the lower position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DCPLayout:
    """Ownership of tokens by DCP rank."""

    world_size: int
    """DCP ranks (W)."""
    interleave: int = 1
    """Tokens per ownership run (I); 1 = token interleave, a sub-block size keeps P->D reads contiguous."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.interleave < 1:
            raise ValueError(f"bad DCPLayout(world_size={self.world_size}, interleave={self.interleave})")

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.interleave) % self.world_size

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        run = self.interleave * self.world_size
        return (positions // run) * self.interleave + positions % self.interleave

    def num_local(self, rank: int, length: int) -> int:
        """Tokens of a `length`-token sequence that `rank` owns (vLLM's get_dcp_local_seq_lens)."""
        size = self.interleave
        base = (length // size // self.world_size) * size
        rem = min(max(length - base * self.world_size - rank * size, 0), size)
        return base + rem

    def global_ids(self, rank: int, num_local: int) -> torch.Tensor:
        """Global positions of local indices 0..num_local-1 of `rank` (strictly increasing)."""
        local = torch.arange(num_local, dtype=torch.int64)
        size = self.interleave
        return (local // size) * (size * self.world_size) + rank * size + local % size

    def shard(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor, in local order."""
        ids = self.global_ids(rank, self.num_local(rank, x.shape[dim]))
        return x.index_select(dim, ids.to(x.device))
