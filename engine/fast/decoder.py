"""FastDecoder: one batched decode step of every running request on the fast path (bf16 weights/activations).

`FastDecoder(model, layout).decode(buffer, token_ids, pages) -> logits [B, V] fp32` runs the same layer stack as
`KimiModel.decode` (engine/model/model.py) with one forward over the batch and no Python loop over requests:
token-wise linears are bf16 GEMMs (a bf16 copy of every matrix is made once); norms, gates, routing and the
FP8 quantisation of the new cache entries run in fp32; the residual stream stays fp32. Per layer:
- MLA: projections, the new token's latent and index key written into its page (`pages.write_token`), the
  indexer (`indexer.select`: in-kernel FP8 keys, scores, top-k) and sparse MLA in absorbed form
  (`mla.sparse_mla_decode`), W_UV and W_O as batched GEMMs over heads;
- KDA: conv step and recurrent step on the packed KDA rows in place (`kda.py`);
- MoE: routed experts as batched GEMMs (gathered per token-slot when few tokens, over all experts otherwise:
  no loop over experts), shared expert and the latent up-projection as GEMMs.
Everything stays on the device; the step has no host synchronisation (the page batch is built beforehand).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.fast.indexer import select
from engine.fast.kda import kda_conv_step, kda_recurrent_step_rows
from engine.fast.mla import sparse_mla_decode
from engine.fast.pages import PageBatch, write_token
from engine.layout import RowLayout
from engine.model.kda import KDA, l2_normalize
from engine.model.mla import MLA
from engine.model.model import KimiModel
from engine.model.moe import DenseMLP, MoE
from engine.model.numerics import fp8_quantize_rowwise, fp8_quantize_static, rms_norm

BF16 = torch.bfloat16


class FastDecoder:
    def __init__(self, model: KimiModel, layout: RowLayout, dtype: torch.dtype = BF16) -> None:
        """`dtype`: of the weight copies and GEMM activations (bf16; fp32 lets tests check the structure tightly)."""
        self.model, self.cfg, self.layout, self.dtype = model, model.cfg, layout, dtype
        self.conv_dtype = {4: torch.float32, 2: BF16}[self.cfg.conv_state_bytes]
        self._bf16 = {id(p): p.detach().to(dtype) for p in model.parameters() if p.dim() >= 2}
        self._const: dict[int, torch.Tensor] = {}
        for layer in model.layers:
            if isinstance(layer.mixer, MLA):
                cfg, mla = self.cfg, layer.mixer
                self._const[id(mla)] = mla.wkv_b.detach().to(dtype).view(
                    cfg.num_heads, cfg.qk_nope_dim + cfg.v_head_dim, cfg.kv_lora_rank)

    def _w(self, param: torch.Tensor) -> torch.Tensor:
        return self._bf16[id(param)]

    def _lin(self, x: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self._w(linear.weight))

    @torch.no_grad()
    def decode(self, buffer: torch.Tensor, token_ids: torch.Tensor, pages: PageBatch) -> torch.Tensor:
        """token_ids [B] (device) decoded at pages.positions -> logits [B, V] fp32; writes the new cache entries
        and KDA states into `buffer` (the pool, [rows, row_bytes] uint8 on the device)."""
        model = self.model
        x = model.embed[token_ids].float()
        for layer_id, layer in enumerate(model.layers):
            h = layer.mixer_norm(x)
            if layer.is_mla:
                x = x + self._mla(layer.mixer, h, buffer, pages, model.mla_index[layer_id])
            else:
                x = x + self._kda(layer.mixer, h, buffer, pages, model.kda_index[layer_id])
            h = layer.ffn_norm(x)
            x = x + (self._dense(layer.ffn, h) if isinstance(layer.ffn, DenseMLP) else self._moe(layer.ffn, h))
        return self._lin(model.final_norm(x), model.lm_head).float()

    def _mla(self, mla: MLA, h: torch.Tensor, buffer: torch.Tensor, pages: PageBatch, index: int) -> torch.Tensor:
        cfg, batch = self.cfg, h.shape[0]
        qr = mla.q_norm(self._lin(h, mla.wq_a).float())
        q = self._lin(qr, mla.wq_b).view(batch, cfg.num_heads, cfg.qk_nope_dim + cfg.qk_rope_dim)
        wkv_b = self._const[id(mla)]  # [H, nope + v, kv_lora]
        q_lat = torch.bmm(q[..., : cfg.qk_nope_dim].transpose(0, 1), wkv_b[:, : cfg.qk_nope_dim])  # [H, B, kv]
        q_abs = torch.cat([q_lat.transpose(0, 1), q[..., cfg.qk_nope_dim :]], dim=-1)
        kv = self._lin(h, mla.wkv_a).float()
        latent = torch.cat([mla.kv_norm(kv[:, : cfg.kv_lora_rank]), kv[:, cfg.kv_lora_rank :]], dim=-1)
        idx = mla.indexer
        key = F.layer_norm(self._lin(h, idx.wk).float(), (cfg.index_head_dim,), idx.k_norm.weight,
                           idx.k_norm.bias, idx.k_norm.eps) @ idx.hadamard
        key_bytes, key_scale = fp8_quantize_rowwise(key)
        qi = self._lin(qr, idx.wq).float().view(batch, cfg.index_num_heads, cfg.index_head_dim) @ idx.hadamard
        qi_bytes, qi_scale = fp8_quantize_rowwise(qi)
        weights = self._lin(h, idx.w_proj).float() * (cfg.index_num_heads * cfg.index_head_dim) ** -0.5 * qi_scale
        write_token(buffer, self.layout, pages, index, fp8_quantize_static(latent, mla.latent_scale), key_bytes,
                    key_scale)
        selected = select(buffer, self.layout, pages, index, qi_bytes.view(torch.float8_e4m3fn).float(), weights,
                          cfg.index_topk)
        o_lat = sparse_mla_decode(buffer, self.layout, pages, index, q_abs, selected, mla.softmax_scale,
                                  mla.latent_scale, cfg.kv_lora_rank)
        o = torch.bmm(o_lat.to(self.dtype).transpose(0, 1), wkv_b[:, cfg.qk_nope_dim :].transpose(1, 2))  # [H, B, v]
        o = o.transpose(0, 1).reshape(batch, -1)
        if mla.wg is not None:
            o = o * torch.sigmoid(self._lin(h, mla.wg).float()).to(self.dtype)
        return self._lin(o, mla.wo).float()

    def _kda(self, kda: KDA, h: torch.Tensor, buffer: torch.Tensor, pages: PageBatch, index: int) -> torch.Tensor:
        cfg, batch = self.cfg, h.shape[0]
        heads, dim = kda.num_heads, kda.head_dim
        raw = self._lin(self._lin(h, kda.w_fa), kda.w_fb).float()
        rate = torch.exp(kda.A_log).repeat_interleave(dim)
        g = (cfg.kda_gate_lower_bound * torch.sigmoid(rate * (raw + kda.dt_bias))).view(batch, heads, dim)
        beta = torch.sigmoid(self._lin(h, kda.w_b).float())
        group, layer_in_group = divmod(index, self.layout.kda_layers_per_group)
        rows = pages.kda_row_ids[:, group].contiguous()
        conv = kda_conv_step(buffer, self.layout, rows, layer_in_group, self._lin(h, kda.w_qkv), kda.conv_weight,
                             self.conv_dtype)
        q, k, v = conv.view(batch, 3, heads, dim).unbind(1)
        q, k = l2_normalize(q) * dim**-0.5, l2_normalize(k)
        o = kda_recurrent_step_rows(buffer, self.layout, rows, layer_in_group, q, k, v, g, beta)
        normed = rms_norm(o, kda.o_norm, cfg.rms_eps).reshape(batch, -1)
        return self._lin(normed * torch.sigmoid(self._lin(h, kda.w_g).float()), kda.wo).float()

    def _dense(self, mlp: DenseMLP, h: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self._lin(h, mlp.w_gate)) * self._lin(h, mlp.w_up)
        return self._lin(hidden, mlp.w_down).float()

    def _moe(self, moe: MoE, h: torch.Tensor) -> torch.Tensor:
        cfg, batch = self.cfg, h.shape[0]
        scores = torch.sigmoid(h @ moe.router.weight.t())  # fp32 routing
        ids = torch.topk(scores + moe.correction_bias, cfg.num_experts_per_tok, dim=-1).indices  # [B, k]
        picked = scores.gather(1, ids)
        weights = picked / picked.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        z = self._lin(h, moe.w_down_latent)  # [B, lat] bf16
        w1, w3, w2 = self._w(moe.w1), self._w(moe.w3), self._w(moe.w2)
        if batch * ids.shape[1] < cfg.num_experts:  # few tokens: each (token, slot) multiplies its own expert
            flat = ids.reshape(-1)
            zz = z.repeat_interleave(ids.shape[1], 0).unsqueeze(-1)  # [B*k, lat, 1]
            hidden = F.silu(torch.bmm(w1[flat], zz)) * torch.bmm(w3[flat], zz)  # [B*k, inter, 1]
            out = torch.bmm(w2[flat], hidden).view(batch, ids.shape[1], -1)  # [B, k, lat]
            mixed = (out.float() * weights.unsqueeze(-1)).sum(1)
        else:  # every expert on every token, weighted by the routing (0 for experts not chosen)
            zb = z.unsqueeze(0).expand(cfg.num_experts, -1, -1)  # [E, B, lat]
            hidden = F.silu(torch.bmm(zb, w1.transpose(1, 2))) * torch.bmm(zb, w3.transpose(1, 2))  # [E, B, inter]
            out = torch.bmm(hidden, w2.transpose(1, 2))  # [E, B, lat]
            dense_w = torch.zeros(batch, cfg.num_experts, device=h.device).scatter_(1, ids, weights)
            mixed = torch.einsum("ebl,be->bl", out.float(), dense_w)
        out = self._lin(moe.latent_norm(mixed), moe.w_up_latent).float()
        return out + self._dense(moe.shared, h) if moe.shared is not None else out
