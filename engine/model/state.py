"""What the model reads and writes per request: the `SequenceCache` protocol and an in-memory implementation.

The model never sees the row pool. It calls, per request:
- `write_attention(mla_index, start, latent, index_key, index_scale)`: FP8 bytes for positions start..start+T-1;
- `read_attention(mla_index, length)`: the raw cached bytes of positions 0..length-1 (`CachedAttention`);
- `read_kda(kda_index)` / `write_kda(kda_index, state)`: the request's KDA state for one KDA layer.
`engine.cache.RowSequenceCache` implements it on the packed row pool; `LocalSequenceCache` here keeps plain
tensors (a reference for tests and for code that runs the model without a pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model.config import ModelConfig


@dataclass
class CachedAttention:
    """Raw cached attention bytes of one request and layer, positions 0..L-1."""

    latent: torch.Tensor  # [L, kv_lora + rope] uint8 (FP8, static scale)
    index_key: torch.Tensor  # [L, d_I] uint8 (FP8)
    index_scale: torch.Tensor  # [L] float32


@dataclass
class KDAState:
    """One request's state of one KDA layer (all heads, or a TP slice of heads)."""

    recurrent: torch.Tensor  # [H, d_k, d_v] float32
    conv: torch.Tensor  # [W-1, 3*H*d] float32, channels q | k | v, head-major inside each

    @staticmethod
    def zeros(cfg: ModelConfig) -> "KDAState":
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        return KDAState(torch.zeros(h, d, d), torch.zeros(cfg.kda_conv_size - 1, 3 * h * d))


class SequenceCache(Protocol):
    def write_attention(
        self, mla_index: int, start: int, latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor
    ) -> None: ...

    def read_attention(self, mla_index: int, length: int) -> CachedAttention: ...

    def read_kda(self, kda_index: int) -> KDAState: ...

    def write_kda(self, kda_index: int, state: KDAState) -> None: ...


class LocalSequenceCache:
    """SequenceCache on plain tensors sized for `capacity` tokens; KDA state starts at zero."""

    def __init__(self, cfg: ModelConfig, capacity: int) -> None:
        n = cfg.num_mla_layers
        self.latent = torch.zeros(n, capacity, cfg.latent_dim, dtype=torch.uint8)
        self.index_key = torch.zeros(n, capacity, cfg.index_head_dim, dtype=torch.uint8)
        self.index_scale = torch.zeros(n, capacity)
        self.kda = [KDAState.zeros(cfg) for _ in range(cfg.num_kda_layers)]

    def write_attention(
        self, mla_index: int, start: int, latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor
    ) -> None:
        end = start + latent.shape[0]
        self.latent[mla_index, start:end] = latent
        self.index_key[mla_index, start:end] = index_key
        self.index_scale[mla_index, start:end] = index_scale

    def read_attention(self, mla_index: int, length: int) -> CachedAttention:
        return CachedAttention(
            self.latent[mla_index, :length], self.index_key[mla_index, :length], self.index_scale[mla_index, :length]
        )

    def read_kda(self, kda_index: int) -> KDAState:
        state = self.kda[kda_index]
        return KDAState(state.recurrent.clone(), state.conv.clone())

    def write_kda(self, kda_index: int, state: KDAState) -> None:
        self.kda[kda_index] = KDAState(state.recurrent.clone(), state.conv.clone())
