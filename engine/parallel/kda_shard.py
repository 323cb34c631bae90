"""KDA head sharding: which heads, conv channels and state slices a rank owns, and the sharded core.

Heads are split evenly (W must divide kda_num_heads): rank r owns heads [r*H/W, (r+1)*H/W). The conv
channels are ordered q | k | v with heads major inside each, so a rank's channels are three runs. The
per-rank KDA state holds only the owned heads (recurrent [H/W, d, d], conv [width-1, 3*H/W*d]), which is
the head-major slice of the full state (LAYOUT.md: a TP slice of a KDA row is one contiguous range).
The core functions of engine.model.kda never mix heads, so running them on a head slice computes exactly
the owned heads' part of the full computation.
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig
from engine.model.kda import KDA, causal_conv, kda_sequential, l2_normalize
from engine.model.state import KDAState, LocalSequenceCache


def head_range(cfg: ModelConfig, world_size: int, rank: int) -> tuple[int, int]:
    if cfg.kda_num_heads % world_size:
        raise ValueError(f"{cfg.kda_num_heads} KDA heads do not split over {world_size} ranks")
    per = cfg.kda_num_heads // world_size
    return rank * per, (rank + 1) * per


def qkv_channels(cfg: ModelConfig, lo: int, hi: int) -> torch.Tensor:
    """Channel ids of heads [lo, hi) in the q | k | v conv layout."""
    d, total = cfg.kda_head_dim, cfg.kda_num_heads * cfg.kda_head_dim
    run = torch.arange(lo * d, hi * d)
    return torch.cat([run, run + total, run + 2 * total])


def shard_state(cfg: ModelConfig, state: KDAState, world_size: int, rank: int) -> KDAState:
    lo, hi = head_range(cfg, world_size, rank)
    return KDAState(state.recurrent[lo:hi].clone(), state.conv[:, qkv_channels(cfg, lo, hi)].clone())


def unshard_states(cfg: ModelConfig, shards: list[KDAState]) -> KDAState:
    """Rank-order head slices -> the full state."""
    full = KDAState.zeros(cfg)
    for rank, part in enumerate(shards):
        lo, hi = head_range(cfg, len(shards), rank)
        full.recurrent[lo:hi] = part.recurrent
        full.conv[:, qkv_channels(cfg, lo, hi)] = part.conv
    return full


def rank_cache(cfg: ModelConfig, capacity: int, world_size: int, rank: int) -> LocalSequenceCache:
    """A LocalSequenceCache whose KDA states hold only this rank's heads (attention rows stay whole)."""
    cache = LocalSequenceCache(cfg, capacity)
    cache.kda = [shard_state(cfg, s, world_size, rank) for s in cache.kda]
    return cache


def kda_core_heads(kda: KDA, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: KDAState
                   ) -> tuple[torch.Tensor, KDAState]:
    """Conv + KDA (token by token, as `KimiModel.prefill`) for one request's T tokens on the heads of `kda` (a
    rank's shard: its heads' conv taps).

    qkv [T, 3*h*d] (the heads' channels), g [T, h, d], beta [T, h], state: the heads' state.
    """
    num_heads, d = g.shape[1], g.shape[2]
    conv_out, conv_state = causal_conv(qkv, state.conv, kda.conv_weight)
    q, k, v = conv_out.view(-1, 3, num_heads, d).unbind(1)
    q = l2_normalize(q) * d**-0.5
    o, recurrent = kda_sequential(q, l2_normalize(k), v, g, beta, state.recurrent)
    return o, KDAState(recurrent, conv_state)
