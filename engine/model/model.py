"""The K3.1-style hybrid decoder: KDA and MLA+DSA layers, dense-then-MoE feed-forward, tied to no cache layout.

`KimiModel.prefill(tokens, cache, start)` runs T new tokens of one request (KDA token by token, query-blocked
sparse MLA) and `KimiModel.decode(tokens, positions, caches)` runs one token for each of B requests (the same KDA
step, one sparse MLA call per request). Both read and write through the `SequenceCache` protocol (engine.model.state).

Batch invariance (decode): every token-wise op runs on rows padded to a multiple of 16 (numerics.py), the attention
core (`decode_attention`) computes exact index dots, selects per row, and attends with per-request [H, C] x [C, k]
products, and the KDA step is element-wise plus reductions over a fixed dim. So a request's logits are bit-identical whether it decodes alone or in any batch.
Prefill = decode, bit for bit: the logits prefill computes for position i equal what decode computes at i after
the same tokens (teacher forcing reproduces served log-probs exactly): the KDA prefill is the decode step applied
token by token, and the sparse MLA scores and attends each query with the ops decode uses.

Pieces the parallel wrappers reuse: `Layer.mixer` (MLA: `project` / `sparse_attention` / `output`; KDA:
`project` / core functions / `output`), `Layer.ffn` (MoE or DenseMLP), and `embed` / `final_norm` / `lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.indexer import IndexQueries, index_keys_to_float
from engine.model.kda import (
    KDA,
    causal_conv,
    causal_conv_step,
    kda_sequential,
    kda_recurrent_step,
)
from engine.model.mla import MLA, AttentionContext, MLAProjection, attention_topk, decode_attention, sparse_attention
from engine.model.moe import DenseMLP, MoE
from engine.model.numerics import (
    RMSNorm,
    RowLinear,
    device_scope,
    pad_rows,
    pad_to,
)
from engine.model.shards import WHOLE, ShardSpec, TensorSplit, tensor_split
from engine.model.state import (
    CachedAttention,
    KDAState,
    SequenceCache,
    read_attention_many,
    read_kda_many,
    write_attention_many,
    write_kda_many,
)

DECODE_ATTENTION_GROUP = 8

Mixer = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
"""A layer's token mixer as a forward path runs it: (MLA or KDA module, normed rows [N, d], index among its kind)
-> output rows [N, d]."""
FFN = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
"""A layer's feed-forward as a forward path runs it: (the FFN module, normed rows [N, d], real rows) -> [N, d]."""


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: ShardSpec = WHOLE) -> None:
        super().__init__()
        self.is_mla = (layer_id + 1) in cfg.mla_layers
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.mixer: MLA | KDA = MLA(cfg, shard) if self.is_mla else KDA(cfg, shard)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn: MoE | DenseMLP = (
            DenseMLP(cfg.d_model, cfg.dense_intermediate) if layer_id < cfg.first_dense_layers else MoE(cfg, shard)
        )


def dequantize_context(cached: CachedAttention, mla: MLA) -> AttentionContext:
    """A layer's cached bytes as float values (latent and index-key formats from the model config)."""
    return AttentionContext(
        latent=mla.decode_latent(cached.latent),
        index_keys=index_keys_to_float(cached.index_key, mla.cfg.index_key_dtype),
        index_scale=cached.index_scale,
    )


def _slice_queries(q: IndexQueries, lo: int, hi: int) -> IndexQueries:
    return IndexQueries(q=q.q[lo:hi], weights=q.weights[lo:hi])


class KimiModel(nn.Module):
    """The model, whole (`shard` WHOLE: `prefill` and `decode` run it on one device) or one rank's shard of it
    (engine/model/shards.py: sharded parameters hold only the rank's rows; only the parallel paths of
    engine/parallel run it). `splits` names every parameter's split and full shape."""

    def __init__(self, cfg: ModelConfig, shard: ShardSpec = WHOLE) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        self.shard = shard
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model), requires_grad=False)
        self.layers = nn.ModuleList(Layer(cfg, i, shard) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.lm_head = RowLinear(cfg.d_model, cfg.vocab_size)
        self.mla_index = {i: cfg.mla_layers.index(i + 1) for i in range(cfg.num_layers) if (i + 1) in cfg.mla_layers}
        self.kda_index = {i: cfg.kda_layers.index(i + 1) for i in range(cfg.num_layers) if (i + 1) in cfg.kda_layers}
        self.splits: dict[str, TensorSplit] = self._splits()

    def _splits(self) -> dict[str, TensorSplit]:
        splits = {name: tensor_split(self.cfg, self.shard, name, tuple(p.shape)) for name, p in self.named_parameters()}
        for name, p in self.named_parameters():
            assert splits[name].local_shape == tuple(p.shape), (name, splits[name], tuple(p.shape))
        return splits

    def _whole_only(self) -> None:
        if not self.shard.is_whole:
            raise RuntimeError(f"rank {self.shard.rank}'s shard of {self.shard.world_size} runs through "
                               "engine/parallel (TPModel / DCPModel), not the single-device forward")

    # ---- prefill: T tokens of one request ----
    def prefill(
        self, token_ids: torch.Tensor, cache: SequenceCache, start: int = 0, all_logits: bool = False
    ) -> torch.Tensor:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V] (all_logits) or [1, V] (last token)."""
        self._whole_only()
        num_tokens = token_ids.shape[0]
        with device_scope(self.device):
            x = pad_rows(self.embed[token_ids.to(self.device)])
            x = self.run_layers(
                x, num_tokens,
                lambda mla, h, i: self._mla_prefill(mla, h, num_tokens, start, cache, i),
                lambda kda, h, i: self._kda_prefill(kda, h, num_tokens, cache, i),
            )
            rows = x[:num_tokens] if all_logits else x[num_tokens - 1 : num_tokens]
            return self.logits(rows)

    def run_layers(self, x: torch.Tensor, num_rows: int, mla_mixer: Mixer, kda_mixer: Mixer,
                   ffn: FFN | None = None) -> torch.Tensor:
        """The layer stack over hidden rows x [N, d] (padded; the first `num_rows` are real): each layer adds its
        mixer's output (`mla_mixer` or `kda_mixer`, called as (module, normed rows, index among its kind)) and
        then its MoE FFN's. The one layer loop: prefill, decode and the parallel paths (engine/parallel) supply
        only their mixers (and `ffn`, how the FFN module is called; default: `module(h, num_rows)`), so every path
        applies norms, residuals and FFNs in the same order."""
        for layer_id, layer in enumerate(self.layers):
            h = layer.mixer_norm(x)
            if layer.is_mla:
                out = mla_mixer(layer.mixer, h, self.mla_index[layer_id])
            else:
                out = kda_mixer(layer.mixer, h, self.kda_index[layer_id])
            x = x + out
            h = layer.ffn_norm(x)
            x = x + (layer.ffn(h, num_rows) if ffn is None else ffn(layer.ffn, h, num_rows))
        return x

    @property
    def device(self) -> torch.device:
        """Where the weights live; forward passes create every tensor there (see numerics.device_scope)."""
        return self.embed.device

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] (unpadded) -> logits [N, V] on padded row blocks."""
        return self.lm_head(self.final_norm(pad_rows(hidden)))[: hidden.shape[0]]

    def _mla_prefill(
        self, mla: MLA, h: torch.Tensor, num_tokens: int, start: int, cache: SequenceCache, mla_index: int
    ) -> torch.Tensor:
        proj = mla.project(h, torch.arange(start, start + num_tokens))
        cache.write_attention(
            mla_index,
            start,
            proj.latent_bytes[:num_tokens],
            proj.index_key_bytes[:num_tokens],
            proj.index_key_scale[:num_tokens],
        )
        ctx = dequantize_context(cache.read_attention(mla_index, start + num_tokens), mla)
        o_lat = sparse_attention(
            proj.q_absorbed[:num_tokens],
            _slice_queries(proj.index_queries, 0, num_tokens),
            torch.arange(start, start + num_tokens),
            ctx,
            attention_topk(self.cfg, start + num_tokens),
            mla.softmax_scale,
            self.cfg.kv_lora_rank,
        )
        return mla.output(pad_to(o_lat, h.shape[0]), proj.gate)

    def _kda_prefill(
        self, kda: KDA, h: torch.Tensor, num_tokens: int, cache: SequenceCache, kda_index: int
    ) -> torch.Tensor:
        proj = kda.project(h)
        state = cache.read_kda(kda_index)
        conv_out, conv_state = causal_conv(proj.qkv[:num_tokens], state.conv, kda.conv_weight)
        q, k, v = kda.split_qkv(conv_out)
        o, recurrent = kda_sequential(q, k, v, proj.g[:num_tokens], proj.beta[:num_tokens], state.recurrent)
        cache.write_kda(kda_index, KDAState(recurrent, conv_state))
        return kda.output(pad_to(o, h.shape[0]), proj.gate_out)

    # ---- decode: one token for each of B requests ----
    def decode(self, token_ids: torch.Tensor, positions: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """token_ids [B] at the given positions -> logits [B, V]."""
        self._whole_only()
        batch = token_ids.shape[0]
        with device_scope(self.device):
            x = pad_rows(self.embed[token_ids.to(self.device)])
            x = self.run_layers(
                x, batch,
                lambda mla, h, i: self.mla_decode(mla, h, positions, caches, i),
                lambda kda, h, i: self._kda_decode(kda, h, caches, i),
            )
            return self.logits(x[:batch])

    def mla_decode(
        self, mla: MLA, h: torch.Tensor, positions: list[int], caches: list[SequenceCache], mla_index: int
    ) -> torch.Tensor:
        """One MLA + DSA layer for B requests at their positions: write the new rows, score, select, attend."""
        proj = mla.project(h, torch.tensor(positions))
        return mla.output(self.decode_attend(mla, proj, h.shape[0], positions, caches, mla_index), proj.gate)

    def decode_attend(self, mla: MLA, proj: MLAProjection, num_rows: int, positions: list[int],
                      caches: list[SequenceCache], mla_index: int) -> torch.Tensor:
        """Write B requests' new cache rows and attend with every head of `proj.q_absorbed` -> o^lat
        [num_rows (padded), H, kv_lora]."""
        batch = len(caches)
        write_attention_many(caches, mla_index, positions, proj.latent_bytes[:batch], proj.index_key_bytes[:batch],
                             proj.index_key_scale[:batch])
        o_lat = proj.q_absorbed.new_zeros(num_rows, proj.q_absorbed.shape[1], self.cfg.kv_lora_rank)
        for lo in range(0, batch, DECODE_ATTENTION_GROUP):  # bounds the padded context tensors
            hi = min(lo + DECODE_ATTENTION_GROUP, batch)
            lengths = [p + 1 for p in positions[lo:hi]]
            cached = read_attention_many(caches[lo:hi], mla_index, lengths)
            o_lat[lo:hi] = decode_attention(
                proj.q_absorbed[lo:hi],
                _slice_queries(proj.index_queries, lo, hi),
                torch.tensor(positions[lo:hi]),
                cached.latent,
                index_keys_to_float(cached.index_key, self.cfg.index_key_dtype),
                cached.index_scale,
                mla.decode_latent,
                attention_topk(self.cfg, max(positions[lo:hi]) + 1),
                mla.softmax_scale,
                self.cfg.kv_lora_rank,
            )
        return o_lat

    def _kda_decode(self, kda: KDA, h: torch.Tensor, caches: list[SequenceCache], kda_index: int) -> torch.Tensor:
        batch = len(caches)
        proj = kda.project(h)
        state = read_kda_many(caches, kda_index)
        conv_out, conv_state = causal_conv_step(proj.qkv[:batch], state.conv, kda.conv_weight)
        q, k, v = kda.split_qkv(conv_out)
        o, recurrent = kda_recurrent_step(q, k, v, proj.g[:batch], proj.beta[:batch], state.recurrent)
        write_kda_many(caches, kda_index, KDAState(recurrent, conv_state))
        return kda.output(pad_to(o, h.shape[0]), proj.gate_out)
