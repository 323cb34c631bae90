"""What the model reads and writes per request: the `SequenceCache` protocol and an in-memory implementation.

The model never sees the row pool. It calls, per request (decode calls the `*_many` helpers below, which use a
cache class's own batched static methods `read_attention_many` / `write_attention_many` / `read_kda_many` /
`write_kda_many` when every cache of the batch has the same class, and loop over the requests otherwise):
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

    latent: torch.Tensor  # [L, (kv_lora + rope) * value bytes] uint8 (FP8 with a static scale, or fp32)
    index_key: torch.Tensor  # [L, index_key_value_bytes] uint8 (FP8 or fp32)
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
        self.latent = torch.zeros(n, capacity, cfg.latent_dim * cfg.latent_value_bytes, dtype=torch.uint8)
        self.index_key = torch.zeros(n, capacity, cfg.index_key_value_bytes, dtype=torch.uint8)
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


def _batched(caches: list, name: str):  # type: ignore[no-untyped-def]
    kind = type(caches[0])
    method = getattr(kind, name, None)
    return method if method is not None and all(type(c) is kind for c in caches) else None


def read_attention_many(caches: list[SequenceCache], mla_index: int, lengths: list[int]) -> CachedAttention:
    """Cached bytes of B requests, zero-padded to the longest: latent [B, Lmax, C], keys [B, Lmax, D], [B, Lmax]."""
    fast = _batched(caches, "read_attention_many")
    if fast is not None:
        return fast(caches, mla_index, lengths)
    parts = [c.read_attention(mla_index, n) for c, n in zip(caches, lengths)]
    longest = max(lengths)

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((longest,) + tuple(t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    return CachedAttention(torch.stack([pad(p.latent) for p in parts]), torch.stack([pad(p.index_key) for p in parts]),
                           torch.stack([pad(p.index_scale) for p in parts]))


def write_attention_many(caches: list[SequenceCache], mla_index: int, positions: list[int], latent: torch.Tensor,
                         index_key: torch.Tensor, index_scale: torch.Tensor) -> None:
    """One token per request: latent [B, C], index_key [B, D], index_scale [B] at the given positions."""
    fast = _batched(caches, "write_attention_many")
    if fast is not None:
        return fast(caches, mla_index, positions, latent, index_key, index_scale)
    for b, (cache, pos) in enumerate(zip(caches, positions)):
        cache.write_attention(mla_index, pos, latent[b : b + 1], index_key[b : b + 1], index_scale[b : b + 1])


def read_kda_many(caches: list[SequenceCache], kda_index: int) -> KDAState:
    """Batched state: recurrent [B, H, d, d], conv [B, W-1, 3*H*d]."""
    fast = _batched(caches, "read_kda_many")
    if fast is not None:
        return fast(caches, kda_index)
    states = [c.read_kda(kda_index) for c in caches]
    return KDAState(torch.stack([s.recurrent for s in states]), torch.stack([s.conv for s in states]))


def write_kda_many(caches: list[SequenceCache], kda_index: int, state: KDAState) -> None:
    fast = _batched(caches, "write_kda_many")
    if fast is not None:
        return fast(caches, kda_index, state)
    for b, cache in enumerate(caches):
        cache.write_kda(kda_index, KDAState(state.recurrent[b], state.conv[b]))
