"""FastPrefiller: a prefill of T tokens of one request on the fast path, writing the packed rows the decode reads.

`FastPrefiller(model, layout).prefill(buffer, token_ids, attn_row_ids, kda_row_ids, start=0, all_logits=False)`
runs the layer stack of `KimiModel.prefill` (engine/model/model.py) for tokens at positions start..start+T-1 and
writes what the reference writes into the pool `buffer` ([rows, row_bytes] uint8 on the model's device): each DSA
layer's FP8 latents and FP8 index keys + fp32 scales of the T tokens into the request's pages, each KDA layer's
recurrent and conv state into its KDA row. `start > 0` continues a request whose earlier tokens are already in
its rows (a resumed prefix, a chunked prefill): keys 0..start-1 are read from the pages, KDA starts from the rows'
states. Returns fp32 logits of the last token [1, V] (all T tokens [T, V] with `all_logits`).

Numerics as FastDecoder (engine/fast/decoder.py): the prefill runs the decoder's own torch segments on its
weights (`_mla_front`, `_mla_back`, `_kda_front`, `_kda_back`, `_ffn_dense`, `_moe_route`, `_moe_out`, `_head`:
bf16 GEMMs; norms, gates, routing and the FP8 quantisation in fp32; the residual stream fp32) over T rows instead
of B, so a FastDecoder built with `compile=True` gives a prefill whose element-wise chains are fused by
torch.compile as well. Between the segments, per layer:
- MLA: the T tokens' cache entries written (`prefill_attention.write_tokens`); the causal indexer over query
  chunks (Triton scores from the FP8 pages + torch.topk, `prefill_select`); sparse MLA in absorbed form over
  the selected FP8 latents read from the pages (`sparse_mla_prefill`);
- KDA: conv over the T tokens from and into the row's conv state, q/k norms, the chunked recurrence (fla-core's
  chunk_kda on CUDA in the bf16 path, prefill_kda.py) from and into the row's recurrent state;
- MoE: routed experts as grouped batched GEMMs over tokens sorted by expert (moe.py).
"""

from __future__ import annotations

import torch

from engine.fast.decoder import BF16, FastDecoder
from engine.fast.moe import grouped_experts
from engine.fast.prefill_attention import prefill_select, sparse_mla_prefill, write_tokens
from engine.fast.prefill_kda import kda_conv_prefill, kda_prefill_core, kda_state_views
from engine.layout import RowLayout
from engine.model.kda import l2_normalize
from engine.model.mla import attention_topk
from engine.model.model import KimiModel


def request_subblocks(layout: RowLayout, attn_row_ids: list[int], num_tokens: int,
                      device: torch.device | str) -> torch.Tensor:
    """Global sub-block ids [P] int32 of a request's tokens 0..num_tokens-1 (page p = tokens [p*b0, (p+1)*b0))."""
    if layout.dcp_size != 1:
        raise ValueError("the fast prefill serves dcp_size 1 pools")
    need = -(-num_tokens // layout.tokens_per_row)
    if len(attn_row_ids) < need:
        raise ValueError(f"{num_tokens} tokens need {need} attention rows, the request has {len(attn_row_ids)}")
    spr = layout.subblocks_per_row
    pages = torch.arange(-(-num_tokens // layout.subblock_tokens))
    rows = torch.tensor(attn_row_ids[:need], dtype=torch.int64)[pages // spr]
    return (rows * spr + pages % spr).to(torch.int32).to(device)


def check_request(layout: RowLayout, num_tokens: int, start: int, kda_row_ids: list[int]) -> None:
    """The arguments of one request's prefill step, checked (a ValueError naming what is wrong)."""
    if num_tokens == 0:
        raise ValueError("a prefill needs at least one token")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if len(kda_row_ids) != layout.kda_groups:
        raise ValueError(f"the request has {len(kda_row_ids)} KDA rows, the layout has {layout.kda_groups} groups")


def attend_selected(buffer: torch.Tensor, layout: RowLayout, subblocks: torch.Tensor, index: int, first: int,
                    q_abs: torch.Tensor, selected: torch.Tensor, m: dict, kv_lora_rank: int) -> torch.Tensor:
    """Sparse MLA of the queries at positions first..first+n-1 over their selections [n, k] -> o^lat [n, H, kv]
    (the slots past the last query's key count stay unused and are cut off first)."""
    selected = selected[:, : min(selected.shape[1], first + q_abs.shape[0])]
    return sparse_mla_prefill(buffer, layout, subblocks, index, q_abs, selected, m["softmax_scale"],
                              m["latent_scale"], kv_lora_rank)


def kda_prefill_rows(buffer: torch.Tensor, layout: RowLayout, row: int, layer_in_group: int,
                     conv_dtype: torch.dtype, conv_in: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, use_fla: bool | None) -> torch.Tensor:
    """One KDA layer's conv and chunked recurrence over T tokens from and into a KDA row: conv_in [T, 3*H*d]
    (the row's heads), g [T, H, d], beta [T, H] -> o [T, H, d]; the row's conv and recurrent states updated."""
    num_tokens, heads, dim = g.shape
    recurrent, conv = kda_state_views(buffer, layout, row, layer_in_group, conv_dtype)
    y = kda_conv_prefill(conv, conv_in, conv_weight)
    q, k, v = y.view(num_tokens, 3, heads, dim).unbind(1)
    o, final = kda_prefill_core(l2_normalize(q) * dim**-0.5, l2_normalize(k), v, g, beta, recurrent,
                                use_fla=use_fla)
    recurrent.copy_(final)
    return o


class FastPrefiller:
    def __init__(self, model: KimiModel, layout: RowLayout, dtype: torch.dtype = BF16,
                 decoder: FastDecoder | None = None) -> None:
        """`decoder`: the FastDecoder of the same model whose weights and segments to run (else one is made)."""
        self.model, self.cfg, self.layout = model, model.cfg, layout
        self.decoder = decoder if decoder is not None else FastDecoder(model, layout, dtype)
        self.conv_dtype = self.decoder.conv_dtype
        self.use_fla = None if self.decoder.dtype == BF16 else False
        """fla-core's chunk_kda (bf16 q, k, v) on CUDA for the bf16 path; fp32 weights and activations (the
        structure checks) keep the fp32 sequential recurrence: with chunk_kda the fp32 fast prefill of mini's
        random weights moved 0.4-34% of the logit range away from the reference on one H200, without it
        0.01-0.17% (2026-12-04)."""

    @torch.no_grad()
    def prefill(self, buffer: torch.Tensor, token_ids: torch.Tensor, attn_row_ids: list[int],
                kda_row_ids: list[int], start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """token_ids [T] at positions start..start+T-1 -> logits [1, V] (or [T, V]) fp32; see the module doc."""
        cfg, dec, num_tokens = self.cfg, self.decoder, token_ids.shape[0]
        check_request(self.layout, num_tokens, start, kda_row_ids)
        subblocks = request_subblocks(self.layout, attn_row_ids, start + num_tokens, buffer.device)
        seg = dec._seg
        x = dec.embed[token_ids.to(buffer.device)].float()
        for layer in dec.layers:
            if layer.kind == "mla":
                x = self._mla(layer.mixer, x, buffer, subblocks, start, layer.index)
            else:
                row = kda_row_ids[layer.index // self.layout.kda_layers_per_group]
                x = self._kda(layer.mixer, x, buffer, row, layer.index)
            f = layer.ffn
            if layer.dense:
                x = seg["_ffn_dense"](x, f["norm"], f["w_gate_up"], f["w_down"], cfg.rms_eps)
            else:
                shared, ids, weights, z = seg["_moe_route"](x, f["norm"], f["router"], f["bias"], f["w_h"],
                                                           cfg.rms_eps, cfg.num_experts_per_tok,
                                                           cfg.routed_scaling_factor, f["latent"], **dec.route_const)
                mixed = grouped_experts(z, ids, weights, f["w1"], f["w3"], f["w2"])  # [T, lat] fp32
                x = seg["_moe_out"](x, shared, mixed, None, f["latent_norm"], f["w_up_latent"], f["shared_down"],
                                    cfg.rms_eps)
        rows = x if all_logits else x[-1:]
        return seg["_head"](rows, dec.final_norm, dec.lm_head, cfg.rms_eps)

    def _mla(self, m: dict, x: torch.Tensor, buffer: torch.Tensor, subblocks: torch.Tensor, start: int,
             index: int) -> torch.Tensor:
        cfg = self.cfg
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        gate, q_abs, latent, key, key_scale, qi, weights = self.decoder._seg["_mla_front"](
            x, *m["front"], positions=positions, **m["front_const"])
        write_tokens(buffer, self.layout, subblocks, index, start, latent, key, key_scale)
        del latent, key
        topk = attention_topk(cfg, start + x.shape[0])
        selected = prefill_select(buffer, self.layout, subblocks, index, start, qi, weights, topk)
        del qi
        o_lat = attend_selected(buffer, self.layout, subblocks, index, start, q_abs, selected, m, cfg.kv_lora_rank)
        return self.decoder._seg["_mla_back"](x, gate, o_lat, m["w_uv"], m["wo"])

    def _kda(self, m: dict, x: torch.Tensor, buffer: torch.Tensor, row: int, index: int) -> torch.Tensor:
        gate, g, beta, conv_in = self.decoder._seg["_kda_front"](x, *m["front"], **m["front_const"])
        o = kda_prefill_rows(buffer, self.layout, row, index % self.layout.kda_layers_per_group, self.conv_dtype,
                             conv_in, m["conv_weight"], g, beta, self.use_fla)
        return self.decoder._seg["_kda_back"](x, gate, o, m["o_norm"], m["wo"], self.cfg.rms_eps)
