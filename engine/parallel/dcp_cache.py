"""One request's cache on one DCP rank: the owned tokens' attention rows and the owned KDA heads.

Attention rows (latent + index key + scale) are kept only for positions the rank owns under its
`DCPLayout`, at their local index, so the local order equals the global order. Writers pass full rows
for positions start..start+T-1 (a local prefill, a transferred prefill row, or one decode token) and the
cache keeps its share. KDA states hold the rank's head slice (`kda_shard`), as under TP.
`from_full` builds a rank's share from a whole-sequence cache (the oracle path and tests).
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig
from engine.model.state import CachedAttention, KDAState, LocalSequenceCache
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.kda_shard import shard_state


class DCPRankCache:
    """Owned attention rows of one request (capacity in global tokens) and this rank's KDA heads."""

    def __init__(self, cfg: ModelConfig, capacity: int, layout: DCPLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        local = layout.num_local(rank, capacity)
        n = cfg.num_mla_layers
        self.latent = torch.zeros(n, local, cfg.latent_dim * cfg.latent_value_bytes, dtype=torch.uint8)
        self.index_key = torch.zeros(n, local, cfg.index_key_value_bytes, dtype=torch.uint8)
        self.index_scale = torch.zeros(n, local)
        self.kda = [shard_state(cfg, KDAState.zeros(cfg), layout.world_size, rank)
                    for _ in range(cfg.num_kda_layers)]

    def write_attention(self, mla_index: int, start: int, latent: torch.Tensor, index_key: torch.Tensor,
                        index_scale: torch.Tensor) -> None:
        positions = torch.arange(start, start + latent.shape[0])
        mine = self.layout.owner(positions) == self.rank
        local = self.layout.local_index(positions[mine])
        self.latent[mla_index, local] = latent[mine]
        self.index_key[mla_index, local] = index_key[mine]
        self.index_scale[mla_index, local] = index_scale[mine]

    def read_owned(self, mla_index: int, length: int) -> CachedAttention:
        """Owned rows among positions 0..length-1, in local (= global) order."""
        n = self.layout.num_local(self.rank, length)
        return CachedAttention(self.latent[mla_index, :n], self.index_key[mla_index, :n],
                               self.index_scale[mla_index, :n])

    def read_kda(self, kda_index: int) -> KDAState:
        state = self.kda[kda_index]
        return KDAState(state.recurrent.clone(), state.conv.clone())

    def write_kda(self, kda_index: int, state: KDAState) -> None:
        self.kda[kda_index] = KDAState(state.recurrent.clone(), state.conv.clone())

    @classmethod
    def from_full(cls, cfg: ModelConfig, full: LocalSequenceCache, length: int, capacity: int,
                  layout: DCPLayout, rank: int) -> "DCPRankCache":
        cache = cls(cfg, capacity, layout, rank)
        for i in range(cfg.num_mla_layers):
            rows = full.read_attention(i, length)
            cache.write_attention(i, 0, rows.latent, rows.index_key, rows.index_scale)
        cache.kda = [shard_state(cfg, full.read_kda(i), layout.world_size, rank) for i in range(cfg.num_kda_layers)]
        return cache
