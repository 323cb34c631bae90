"""FastDecoder: one batched decode step of every running request on the fast path (bf16 weights/activations).

`FastDecoder(model, layout).decode(buffer, token_ids, pages) -> logits [B, V] fp32` runs the same layer stack as
`KimiModel.decode` (engine/model/model.py) with one forward over the batch and no Python loop over requests:
token-wise linears are bf16 GEMMs (a bf16 copy of every matrix is made once; matrices that read the same
input are stacked into one); norms, gates, routing and the FP8 quantisation of the new cache entries run in
fp32; the residual stream stays fp32. Per layer:
- MLA: projections, the new token's latent and index key written into its page (`pages.write_token`), the
  indexer (`indexer.select`: in-kernel FP8 keys, scores, top-k) and sparse MLA in absorbed form
  (`mla.sparse_mla_decode`), W_UV and W_O as batched GEMMs over heads;
- KDA: conv step fused with the query/key norms, then the recurrent step, both on the packed KDA rows in place
  (`kda.py`);
- MoE: with few tokens (B * k < E) each (token, slot) reads its own expert's matrices in place
  (`expert_gemv.py`, two Triton kernels); otherwise batched GEMMs over all experts weighted by the routing (no
  loop over experts); shared expert and the latent up-projection as GEMMs.

The torch work between the kernels is written as pure functions of tensors (the `_mla_front`, `_mla_back`,
`_kda_front`, `_kda_back`, `_ffn_*`, `_head` segments below). With `compile=True` each segment runs through
`torch.compile` (dynamic batch size: one compilation serves every batch), which fuses its element-wise chains
(norms, gates, quantisation, routing, residual adds) into a few generated kernels around the GEMMs; the
Triton kernels that read and write the row pool stay outside the compiled graphs. `compile=False` runs the
same functions eagerly (the CPU tests, and the reference for the compiled path).
Everything stays on the device; the step has no host synchronisation (the page batch is built beforehand).

Checkpoint semantics (engine/model/config.py fields; engine/fast/support.py says which configs run here): the MLA
front rotates q^R, k^R and the indexer's rope dims at the rows' positions (`_rotate`, the reference's
`apply_rope`), takes the normed input as the query latent when the query is full-rank, and for a dense MLA writes
zero index keys and selects every key (`attention_topk`); the KDA front computes the softplus gate; the MoE runs
its experts on the normed input when there is no latent, with grouped top-k (`_group_mask`) and optional
renormalisation.

Linears of up to GEMV_MAX_ROWS rows on CUDA run `gemv.gemv` (one weight-streaming kernel each) where the
launch cost is paid once: inside compiled segments and in steps run under `gemv_kernels()` (what
graphs.GraphedDecode does for its warm-up and capture). A plain eager step launches every kernel from Python
each time, and there cuBLAS (F.linear) launches cheaper than the custom op and Triton's launcher: on one H200
the eager pro-rank b1 step took ~13 ms with F.linear (2026-12-03) and 21-25 ms with gemv (2026-12-04; runs of
different days, not side by side: benchmarks/RESULTS.md), while the graphed step went from 1.88 to 1.50 ms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.fast.expert_gemv import expert_gemv
from engine.fast.gemv import GEMV_MAX_ROWS, gemv
from engine.fast.gemv import supports as gemv_supports
from engine.fast.indexer import select
from engine.fast.kda import kda_conv_qkv_rows, kda_recurrent_step_rows
from engine.fast.mla import merge_splits, sparse_mla_decode
from engine.fast.pages import PageBatch, write_token
from engine.fast.support import fast_unsupported
from engine.layout import RowLayout
from engine.model.kda import KDA
from engine.model.mla import MLA, attention_topk
from engine.model.model import KimiModel
from engine.model.moe import DenseMLP, MoE
from engine.model.numerics import FP8_DTYPE, fp8_quantize_rowwise, fp8_quantize_static, rms_norm

BF16 = torch.bfloat16


_GEMV_STEPS = [False]


@contextlib.contextmanager
def gemv_kernels() -> Iterator[None]:
    """Steps run inside this block take `gemv` for their few-row linears even when eager (see the module doc):
    for a step that is captured into a CUDA graph, and for the eager run before the capture that compiles the
    same kernels."""
    before = _GEMV_STEPS[0]
    _GEMV_STEPS[0] = True
    try:
        yield
    finally:
        _GEMV_STEPS[0] = before


def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in w's dtype: `gemv` for a CUDA batch of up to GEMV_MAX_ROWS rows of bf16 (weight-streaming
    matrix-vector products) in compiled segments and under `gemv_kernels()`, else F.linear."""
    if (x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and w.dtype == BF16 and gemv_supports(w.shape[1])
            and (torch.compiler.is_compiling() or _GEMV_STEPS[0])):
        return gemv(x, w)
    return F.linear(x.to(w.dtype), w)


STACKED_MAX_ROWS = 256
"""Up to this many rows a stacked weight is one linear; above, one GEMM per part (see `_lin_split`)."""


def _lin_split(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """x @ w^T of a stacked weight, split into its parts' outputs: one linear at decode batch sizes (one
    weight stream: `gemv` up to GEMV_MAX_ROWS rows, one GEMM to STACKED_MAX_ROWS), one GEMM per part above
    (long prefills: contiguous outputs, the GEMM shapes of the unstacked matrices; the parts are views of
    `w`). On one H200 the stacked form made the b32 decode step ~8% faster and a 32K-token prefill ~10%
    slower (benchmarks/RESULTS.md, 2026-12-04)."""
    if x.shape[0] <= STACKED_MAX_ROWS:
        return list(_lin(x, w).split(sizes, dim=-1))
    return [_lin(x, part) for part in w.split(sizes, dim=0)]


ROUTE_FUSED_MAX_ROWS = 64
"""Up to this many rows `_route` computes the router dots and the top-k inside the compiled segment. On one H200
the graphed pro-rank b32 / 128K step took 2.503 ms with 64 against 2.633 ms with 8 (an fp32 GEMM, torch.topk's
sort and gather kernels per MoE layer; benchmarks/RESULTS.md, 2026-12-04)."""


def _group_mask(biased: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """Grouped top-k (engine.model.moe.mask_groups): experts outside the `keep` groups with the best top-2 sums
    set to -inf."""
    rows, experts = biased.shape
    grouped = biased.view(rows, groups, experts // groups)
    best = torch.topk(grouped, 2, dim=-1).values.sum(-1)  # [B, G]
    kept = torch.topk(best, keep, dim=-1).indices
    allowed = torch.zeros_like(best, dtype=torch.bool).scatter(1, kept, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(rows, experts)


def _route(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int = 1,
           keep_groups: int = 1) -> tuple[torch.Tensor, ...]:
    """Router scores (fp32 sigmoid) and the top-k expert ids by score + bias (within the kept groups of a grouped
    top-k), best first. Up to ROUTE_FUSED_MAX_ROWS rows the dot products and the selection (k rounds of arg-max,
    each taking the first of equal maxima) are elementwise work and reductions that torch.compile fuses into the
    segment's kernels; larger batches (prefill) use a matmul and torch.topk."""
    if h.shape[0] > ROUTE_FUSED_MAX_ROWS:
        scores = torch.sigmoid(h @ router.t())
        biased = scores + bias
        if groups > 1:
            biased = _group_mask(biased, groups, keep_groups)
        return scores, torch.topk(biased, top_k, dim=-1).indices
    scores = torch.sigmoid((h.unsqueeze(1) * router.unsqueeze(0)).sum(-1))  # [B, E]
    left = scores + bias
    if groups > 1:
        left = _group_mask(left, groups, keep_groups)
    experts = torch.arange(left.shape[1], device=left.device)
    picks = []
    for _ in range(top_k):  # element-wise masking between the rounds (no scatter): one fusable chain
        best = left.argmax(dim=-1, keepdim=True)
        picks.append(best)
        left = torch.where(experts == best, float("-inf"), left)
    return scores, torch.cat(picks, dim=1)


def _rotate(x: torch.Tensor, positions: torch.Tensor | None, style: str, inv_freq: torch.Tensor | None,
            factor: float) -> torch.Tensor:
    """engine.model.numerics.apply_rope on the segment's tensors (fp32 angles; "none": x)."""
    if style == "none":
        return x
    angles = positions.float().unsqueeze(-1) * inv_freq  # [N, r/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[-1],)
    cos, sin = (angles.cos() * factor).view(shape), (angles.sin() * factor).view(shape)
    a, b = (x[..., 0::2], x[..., 1::2]) if style == "interleaved" else x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _mla_front(x: torch.Tensor, norm: torch.Tensor, w_h: torch.Tensor, q_norm: torch.Tensor | None,
               w_qr: torch.Tensor, w_uk: torch.Tensor, kv_norm: torch.Tensor, k_norm_w: torch.Tensor | None,
               k_norm_b: torch.Tensor | None, hadamard: torch.Tensor, eps: float, k_eps: float, latent_scale: float,
               heads: int, nope: int, kv_rank: int, index_heads: int, h_split: list[int], qr_split: list[int],
               inv_freq: torch.Tensor | None = None, positions: torch.Tensor | None = None, mla_rope: str = "none",
               index_rope: str = "none", rope_factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Queries (absorbed), the new token's latent and index key (FP8 bytes), the index queries and head weights
    and the output gate (None without one) of one MLA layer. `w_h` is every projection of the normed input
    stacked (wq_a unless the query is full-rank, wkv_a, the indexer's wk and w_proj unless the MLA is dense,
    then wg where the layer has one; sizes `h_split`) and `w_qr` the ones of the query latent (wq_b, the indexer's
    wq; `qr_split`): one linear each. Rotary (checkpoints): q^R and k^R rotated by `mla_rope`, the indexer's first
    rope dims by `index_rope`, at `positions` with `inv_freq` and cos/sin scaled by `rope_factor`. A dense MLA
    (`k_norm_w` None) returns zero index keys, queries and weights: nothing scores them."""
    batch = x.shape[0]
    h = rms_norm(x, norm, eps)
    parts = _lin_split(h, w_h, h_split)
    if q_norm is not None:
        q_a, parts = parts[0], parts[1:]
        qr = rms_norm(q_a.float(), q_norm, eps)
    else:
        qr = h
    indexed = k_norm_w is not None
    kv = parts[0]
    idx_k, idx_w = (parts[1], parts[2]) if indexed else (None, None)
    rest = parts[3:] if indexed else parts[1:]
    gate = torch.sigmoid(rest[0].float()) if rest else None
    q_parts = _lin_split(qr, w_qr, qr_split)
    q = q_parts[0].reshape(batch, heads, -1)
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [H, B, kv]
    q_rope = _rotate(q[..., nope:].float(), positions, mla_rope, inv_freq, rope_factor)
    q_abs = torch.cat([q_lat.transpose(0, 1), q_rope.to(q_lat.dtype)], dim=-1)
    kv = kv.float()
    k_rope = _rotate(kv[:, kv_rank:], positions, mla_rope, inv_freq, rope_factor)
    latent = torch.cat([rms_norm(kv[:, :kv_rank], kv_norm, eps), k_rope], dim=-1)
    latent_bytes = fp8_quantize_static(latent, latent_scale)
    dim = hadamard.shape[0]
    if not indexed:
        zeros = torch.zeros(batch, index_heads, dim, device=x.device)
        return (gate, q_abs, latent_bytes, torch.zeros(batch, dim, dtype=torch.uint8, device=x.device),
                torch.zeros(batch, device=x.device), zeros, torch.zeros(batch, index_heads, device=x.device))
    rope_dim = inv_freq.shape[0] * 2 if inv_freq is not None else 0
    key = F.layer_norm(idx_k.float(), (dim,), k_norm_w, k_norm_b, k_eps)
    qi = q_parts[1].float().reshape(batch, index_heads, dim)
    if index_rope != "none":
        key = torch.cat([_rotate(key[:, :rope_dim], positions, index_rope, inv_freq, rope_factor),
                         key[:, rope_dim:]], dim=-1)
        qi = torch.cat([_rotate(qi[..., :rope_dim], positions, index_rope, inv_freq, rope_factor),
                        qi[..., rope_dim:]], dim=-1)
    key_bytes, key_scale = fp8_quantize_rowwise(key @ hadamard)
    qi_bytes, qi_scale = fp8_quantize_rowwise(qi @ hadamard)
    weights = idx_w.float() * (index_heads * dim) ** -0.5 * qi_scale
    return gate, q_abs, latent_bytes, key_bytes, key_scale, qi_bytes.view(FP8_DTYPE).float(), weights


def _mla_back(x: torch.Tensor, gate: torch.Tensor | None, o_lat: torch.Tensor, w_uv: torch.Tensor,
              wo: torch.Tensor) -> torch.Tensor:
    """x + W_O(gate * W_UV o^lat) of one MLA layer."""
    o = torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv)  # [H, B, v]
    o = o.transpose(0, 1).reshape(x.shape[0], -1)
    if gate is not None:
        o = o * gate.to(o.dtype)
    return x + _lin(o, wo).float()


def _mla_back_splits(x: torch.Tensor, gate: torch.Tensor | None, partial: torch.Tensor, lse: torch.Tensor,
                     latent_scale: float, w_uv: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """`_mla_back` of the sparse MLA's unmerged splits: their merge fuses into this segment's kernels."""
    return _mla_back(x, gate, merge_splits(partial, lse, latent_scale), w_uv, wo)


def _kda_front(x: torch.Tensor, norm: torch.Tensor, w_h: torch.Tensor, w_fb: torch.Tensor, rate: torch.Tensor,
               dt_bias: torch.Tensor, eps: float, lower_bound: float, heads: int,
               h_split: list[int], softplus: bool = False) -> tuple[torch.Tensor, ...]:
    """The output gate, the decay gate g [B, H, d], beta [B, H] and the conv input of one KDA layer. `w_h` is
    every projection of the normed input stacked (w_fa, w_b, w_qkv, w_g; sizes `h_split`): one linear."""
    batch = x.shape[0]
    h = rms_norm(x, norm, eps)
    f_a, b, qkv, gate = _lin_split(h, w_h, h_split)
    raw = _lin(f_a, w_fb).float()
    if softplus:  # Kimi-Linear's gate: -exp(A_log) * softplus(f + dt_bias)
        g = (-rate * F.softplus(raw + dt_bias)).view(batch, heads, -1)
    else:
        g = (lower_bound * torch.sigmoid(rate * (raw + dt_bias))).view(batch, heads, -1)
    beta = torch.sigmoid(b.float())
    return torch.sigmoid(gate.float()), g, beta, qkv.contiguous()


def _kda_back(x: torch.Tensor, gate: torch.Tensor, o: torch.Tensor, o_norm: torch.Tensor, wo: torch.Tensor,
              eps: float) -> torch.Tensor:
    normed = rms_norm(o, o_norm, eps).reshape(x.shape[0], -1)
    return x + _lin(normed * gate, wo).float()


def _ffn_dense(x: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               eps: float) -> torch.Tensor:
    """x + the dense MLP; `w_gate_up` stacks its gate and up projections."""
    inter = w_gate_up.shape[0] // 2
    gate, up = _lin_split(rms_norm(x, norm, eps), w_gate_up, [inter, inter])
    return x + _lin(F.silu(gate) * up, w_down).float()


def _moe_route(x: torch.Tensor, norm: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
               w_h: torch.Tensor | None, eps: float, top_k: int, scaling: float,
               latent: int, groups: int = 1, keep_groups: int = 1, renormalize: bool = True,
               dtype: torch.dtype = BF16) -> tuple[torch.Tensor, ...]:
    """Routing (fp32: expert ids [B, k] and their weights), the experts' input z [B, latent] (latent 0: the normed
    rows themselves, in `dtype`) and the shared expert's activation (None without one) of a MoE layer. `w_h`
    stacks the projections of the normed input (w_down_latent where there is a latent, then the shared expert's
    gate and up): one linear."""
    h = rms_norm(x, norm, eps)
    scores, ids = _route(h, router, bias, top_k, groups, keep_groups)  # [B, E], [B, k]
    picked = scores.gather(1, ids)
    weights = (picked / picked.sum(-1, keepdim=True) if renormalize else picked) * scaling
    if w_h is None:
        return None, ids, weights, h.to(dtype).contiguous()
    inter = (w_h.shape[0] - latent) // 2
    parts = _lin_split(h, w_h, ([latent] if latent else []) + ([inter, inter] if inter else []))
    shared = F.silu(parts[-2]) * parts[-1] if inter else None
    z = parts[0].contiguous() if latent else h.to(w_h.dtype).contiguous()
    return shared, ids, weights, z


def _moe_all_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (0 for experts not chosen) -> mixed [B, lat] fp32."""
    experts = w1.shape[0]
    zb = z.unsqueeze(0).expand(experts, -1, -1)  # [E, B, lat]
    hidden = F.silu(torch.bmm(zb, w1.transpose(1, 2))) * torch.bmm(zb, w3.transpose(1, 2))  # [E, B, inter]
    out = torch.bmm(hidden, w2.transpose(1, 2))  # [E, B, lat]
    dense_w = torch.zeros(z.shape[0], experts, device=z.device).scatter_(1, ids, weights)
    return torch.einsum("ebl,be->bl", out.float(), dense_w)


def _moe_out(x: torch.Tensor, shared: torch.Tensor | None, experts_out: torch.Tensor, weights: torch.Tensor | None,
             latent_norm: torch.Tensor | None, w_up_latent: torch.Tensor | None, shared_down: torch.Tensor | None,
             eps: float) -> torch.Tensor:
    """x + the MoE output: `experts_out` is [B, k, lat] per slot (mixed here by `weights`) or [B, lat] mixed;
    `shared` the shared expert's activation (`_moe_route`) and `shared_down` its down projection."""
    mixed = experts_out if weights is None else (experts_out.float() * weights.unsqueeze(-1)).sum(1)
    out = _lin(rms_norm(mixed, latent_norm, eps), w_up_latent).float() if w_up_latent is not None else mixed.float()
    if shared is not None:
        out = out + _lin(shared, shared_down).float()
    return x + out


def _head(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    return _lin(rms_norm(x, norm, eps), lm_head).float()


SEGMENTS = ("_mla_front", "_mla_back", "_mla_back_splits", "_kda_front", "_kda_back", "_ffn_dense", "_moe_route",
            "_moe_all_experts", "_moe_out", "_head")


@dataclass
class _LayerWeights:
    """One layer's tensors in the form the segments take (bf16 matrices, fp32 vectors)."""

    kind: str  # "mla" | "kda"
    index: int  # among layers of its kind
    mixer: dict[str, Any]
    ffn: dict[str, Any]
    dense: bool


class FastDecoder:
    PARALLELISM = "single"
    """What `fast_unsupported` checks this decoder's model against (the TP/DCP subclasses: "tp")."""

    def __init__(self, model: KimiModel, layout: RowLayout, dtype: torch.dtype = BF16, compile: bool = False) -> None:
        """`dtype`: of the weight copies and GEMM activations (bf16; fp32 lets tests check the structure tightly).
        `compile`: run the torch segments through torch.compile (CUDA; see the module docstring)."""
        lacks = fast_unsupported(model.cfg, self.PARALLELISM)
        if lacks is not None:
            raise ValueError(lacks)
        self.model, self.cfg, self.layout, self.dtype = model, model.cfg, layout, dtype
        self.conv_dtype = {4: torch.float32, 2: BF16}[self.cfg.conv_state_bytes]
        self.compiled = compile
        self._seg: dict[str, Callable[..., Any]] = {name: globals()[name] for name in SEGMENTS}
        if compile:
            self._seg = {name: torch.compile(fn, dynamic=True) for name, fn in self._seg.items()}
        w = self._w
        self.layers: list[_LayerWeights] = []
        for layer_id, layer in enumerate(model.layers):
            if layer.is_mla:
                mixer = self._mla_weights(layer.mixer, layer.mixer_norm.weight)
                kind, index = "mla", model.mla_index[layer_id]
            else:
                mixer = self._kda_weights(layer.mixer, layer.mixer_norm.weight)
                kind, index = "kda", model.kda_index[layer_id]
            ffn, dense = layer.ffn, isinstance(layer.ffn, DenseMLP)
            if dense:
                weights = {"norm": layer.ffn_norm.weight, "w_gate_up": self._stack(ffn.w_gate.weight, ffn.w_up.weight),
                           "w_down": w(ffn.w_down.weight)}
            else:  # a MoE, or on a TP/DCP rank its expert-parallel form (the same tensors; engine/parallel/tp.py)
                assert isinstance(ffn, MoE) or hasattr(ffn, "per_rank"), type(ffn)
                latent = ffn.w_down_latent is not None
                projections = [ffn.w_down_latent.weight] if latent else []
                if ffn.shared is not None:
                    projections += [ffn.shared.w_gate.weight, ffn.shared.w_up.weight]
                weights = {"norm": layer.ffn_norm.weight, "router": ffn.router.weight, "bias": ffn.correction_bias,
                           "w_h": self._stack(*projections) if projections else None,
                           "latent": ffn.w_down_latent.weight.shape[0] if latent else 0,
                           "w1": w(ffn.w1), "w3": w(ffn.w3), "w2": w(ffn.w2),
                           "latent_norm": ffn.latent_norm.weight if latent else None,
                           "w_up_latent": w(ffn.w_up_latent.weight) if latent else None,
                           "shared_down": None if ffn.shared is None else w(ffn.shared.w_down.weight)}
            self.layers.append(_LayerWeights(kind, index, mixer, weights, dense))
        self.route_const = dict(groups=self.cfg.num_expert_groups, keep_groups=self.cfg.topk_groups,
                                renormalize=self.cfg.moe_renormalize, dtype=dtype)
        """The routing settings `_moe_route` takes beyond the presets' (grouped top-k, renormalisation)."""
        self.embed = model.embed
        self.final_norm = model.final_norm.weight
        self.lm_head = w(model.lm_head.weight)

    def _w(self, param: torch.Tensor) -> torch.Tensor:
        """The copy in `dtype` of a weight matrix (made once, here; engine/fast/prefill.py runs the same copies)."""
        return param.detach().to(self.dtype)

    def _stack(self, *params: torch.Tensor) -> torch.Tensor:
        """Matrices that read the same input, stacked along the output features in `dtype`: one linear reads
        them all (at decode batch sizes one weight stream instead of several short ones); the segments split
        its output."""
        return torch.cat([self._w(p) for p in params], dim=0)

    def _mla_weights(self, mla: MLA, norm: torch.Tensor) -> dict[str, Any]:
        cfg, w = self.cfg, self._w
        heads = mla.num_local_heads  # all of them on one rank; a TP/DCP rank's shard holds its heads' rows
        wkv_b = w(mla.wkv_b).view(heads, cfg.qk_nope_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        idx = mla.indexer
        on_h = ([mla.wq_a.weight] if mla.wq_a is not None else []) + [mla.wkv_a.weight]
        on_qr = [mla.wq_b.weight]
        if idx is not None:
            on_h += [idx.wk.weight, idx.w_proj.weight]
            on_qr.append(idx.wq.weight)
        if mla.wg is not None:
            on_h.append(mla.wg.weight)
        rotary = mla.rotary
        rope = cfg.mla_rope != "none" or cfg.index_rope != "none"
        hadamard = idx.hadamard if idx is not None else torch.eye(cfg.index_head_dim, device=norm.device)
        return {
            "front": (norm, self._stack(*on_h), mla.q_norm.weight if mla.q_norm is not None else None,
                      self._stack(*on_qr), wkv_b[:, : cfg.qk_nope_dim].contiguous(), mla.kv_norm.weight,
                      idx.k_norm.weight if idx is not None else None, idx.k_norm.bias if idx is not None else None,
                      hadamard),
            "front_const": dict(eps=cfg.rms_eps, k_eps=idx.k_norm.eps if idx is not None else 0.0,
                                latent_scale=mla.latent_scale, heads=heads, nope=cfg.qk_nope_dim,
                                kv_rank=cfg.kv_lora_rank, index_heads=cfg.index_num_heads,
                                h_split=[p.shape[0] for p in on_h], qr_split=[p.shape[0] for p in on_qr],
                                mla_rope=cfg.mla_rope, index_rope=cfg.index_rope, rope_factor=rotary.attention_factor,
                                inv_freq=rotary.inv_freq(cfg.qk_rope_dim).to(norm.device) if rope else None),
            "w_uv": wkv_b[:, cfg.qk_nope_dim :].transpose(1, 2).contiguous(),  # [H, kv, v]
            "wo": w(mla.wo.weight),
            "softmax_scale": mla.softmax_scale,
            "latent_scale": mla.latent_scale,
        }

    def _kda_weights(self, kda: KDA, norm: torch.Tensor) -> dict[str, Any]:
        return self._kda_pack(kda, norm, kda.w_fb.weight, torch.exp(kda.A_log).repeat_interleave(kda.head_dim),
                              kda.dt_bias, kda.w_b.weight, kda.w_qkv.weight, kda.conv_weight, kda.num_heads)

    def _kda_pack(self, kda: KDA, norm: torch.Tensor, w_fb: torch.Tensor, rate: torch.Tensor, dt_bias: torch.Tensor,
                  w_b: torch.Tensor, w_qkv: torch.Tensor, conv_weight: torch.Tensor, heads: int) -> dict[str, Any]:
        """A KDA layer's tensors for the segments, from its head-wise parts (all heads here; one rank's heads in
        engine/parallel/fast_tp.py)."""
        on_h = [kda.w_fa.weight, w_b, w_qkv, kda.w_g.weight]
        return {
            "front": (norm, self._stack(*on_h), self._w(w_fb).contiguous(), rate, dt_bias.contiguous()),
            "front_const": dict(eps=self.cfg.rms_eps, lower_bound=self.cfg.kda_gate_lower_bound, heads=heads,
                                h_split=[p.shape[0] for p in on_h], softplus=self.cfg.kda_gate == "softplus"),
            "conv_weight": conv_weight.detach().float().contiguous(),
            "o_norm": kda.o_norm, "wo": self._w(kda.wo.weight),
        }

    @torch.no_grad()
    def decode(self, buffer: torch.Tensor, token_ids: torch.Tensor, pages: PageBatch) -> torch.Tensor:
        """token_ids [B] (device) decoded at pages.positions -> logits [B, V] fp32; writes the new cache entries
        and KDA states into `buffer` (the pool, [rows, row_bytes] uint8 on the device)."""
        cfg, seg = self.cfg, self._seg
        x = self.embed[token_ids].float()
        for layer in self.layers:
            if layer.kind == "mla":
                x = self._mla(layer.mixer, x, buffer, pages, layer.index)
            else:
                x = self._kda(layer.mixer, x, buffer, pages, layer.index)
            f = layer.ffn
            if layer.dense:
                x = seg["_ffn_dense"](x, f["norm"], f["w_gate_up"], f["w_down"], cfg.rms_eps)
            else:
                x = self._moe(f, x)
        return seg["_head"](x, self.final_norm, self.lm_head, cfg.rms_eps)

    def _moe(self, f: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        cfg, seg = self.cfg, self._seg
        shared, ids, weights, z = seg["_moe_route"](x, f["norm"], f["router"], f["bias"], f["w_h"], cfg.rms_eps,
                                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor, f["latent"],
                                                    **self.route_const)
        if x.shape[0] * cfg.num_experts_per_tok < cfg.num_experts and self.dtype == BF16:
            out = expert_gemv(z, ids, f["w1"], f["w3"], f["w2"])  # few tokens: each slot reads its own expert
        else:
            out, weights = seg["_moe_all_experts"](z, ids, weights, f["w1"], f["w3"], f["w2"]), None
        return seg["_moe_out"](x, shared, out, weights, f["latent_norm"], f["w_up_latent"], f["shared_down"],
                               cfg.rms_eps)

    def _mla(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
             index: int) -> torch.Tensor:
        gate, partial, lse = self._mla_splits(m, x, buffer, pages, index)
        return self._seg["_mla_back_splits"](x, gate, partial, lse, m["latent_scale"], m["w_uv"], m["wo"])

    def _mla_splits(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
                    index: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The MLA step up to the sparse attention of this decoder's heads: (gate, the unmerged splits, their
        log-sum-exp)."""
        cfg = self.cfg
        gate, q_abs, latent, key, key_scale, qi, weights = self._seg["_mla_front"](
            x, *m["front"], positions=pages.positions, **m["front_const"])
        write_token(buffer, self.layout, pages, index, latent, key, key_scale)
        selected = select(buffer, self.layout, pages, index, qi, weights, attention_topk(cfg, pages.max_len))
        partial, lse = sparse_mla_decode(buffer, self.layout, pages, index, q_abs, selected, m["softmax_scale"],
                                         m["latent_scale"], cfg.kv_lora_rank, merge=False)
        return gate, partial, lse

    def _kda(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
             index: int) -> torch.Tensor:
        gate, o = self._kda_heads(m, x, buffer, pages, index)
        return self._seg["_kda_back"](x, gate, o, m["o_norm"], m["wo"], self.cfg.rms_eps)

    def _kda_heads(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
                   index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The KDA step of this decoder's heads up to their outputs: (output gate, o [B, heads, d])."""
        gate, g, beta, conv_in = self._seg["_kda_front"](x, *m["front"], **m["front_const"])
        group, layer_in_group = divmod(index, self.layout.kda_layers_per_group)
        rows = pages.kda_row_ids[:, group].contiguous()
        q, k, v = kda_conv_qkv_rows(buffer, self.layout, rows, layer_in_group, conv_in, m["conv_weight"],
                                    self.conv_dtype)
        return gate, kda_recurrent_step_rows(buffer, self.layout, rows, layer_in_group, q, k, v, g, beta)
