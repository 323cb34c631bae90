"""DSA lightning indexer: FP8 index keys, exact index scores, stable causal top-k.

Math (K3.1: no RoPE on the indexer; DeepSeek-V3.2: `index_rope` "half" rotates the first qk_rope_dim dims of
every query head and of the key by their positions, written R_t below):
    q^I_{t,h} = Hadamard(R_t (W_q qr_t)_h)      k^I_s = Hadamard(R_s LayerNorm(W_k x_s))
    (q^, s^q) = fp8 per head vector             (k^, s^k) = fp8 per token (one fp32 scale per token)
    w_{t,h}   = (W_w x_t)_h * H_I^-1/2 * d_I^-1/2 * s^q_{t,h}
    I_{t,s}   = s^k_s * sum_h w_{t,h} * ReLU(q^_{t,h} . k^_s)      for s <= t
    Sel_t     = the index_topk best s (ties to the lower position); every s <= t when t + 1 <= index_topk

Exact scoring (`index_key_dtype` "fp32"): no rotation, no rounding: q^ and k^ are the fp32 vectors, s^q = s^k
= 1 (the Hadamard rotation only spreads outliers before FP8; it preserves dot products).

Exactness: e4m3 x e4m3 products are multiples of 2^-18 below 2^18, so a d_I-term dot product in float64 is exact
and independent of summation order. The rest is element-wise fp32 with the head sum in fixed order, so a
score does not depend on the query block, the batch, or how many keys are scored alongside it.
Selections come back as [T, k] int64 ascending positions, padded with -1 at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.numerics import (
    RowLinear,
    Rotary,
    apply_rope,
    fp8_quantize_rowwise,
    fp8_to_float,
    hadamard_matrix,
    yarn_mscale,
)


@dataclass
class IndexQueries:
    """Per query token: FP8 query values (as exact fp32) and the per-head weights that fold in s^q."""

    q: torch.Tensor  # [T, H_I, d_I] float32 holding e4m3 values
    weights: torch.Tensor  # [T, H_I] float32


class Indexer(nn.Module):
    """Projections of the indexer; scoring and selection are the free functions below."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.index_num_heads
        self.head_dim = cfg.index_head_dim
        self.is_exact = cfg.index_key_dtype == "fp32"
        self.rotary = model_rotary(cfg)
        self.wq = RowLinear(cfg.q_lora_rank, cfg.index_num_heads * cfg.index_head_dim)
        self.wk = RowLinear(cfg.d_model, cfg.index_head_dim)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=cfg.index_norm_eps)
        self.k_norm.requires_grad_(False)
        self.w_proj = RowLinear(cfg.d_model, cfg.index_num_heads)
        self.register_buffer("hadamard", hadamard_matrix(cfg.index_head_dim), persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Rotate the first qk_rope_dim dims of x [R, ..., d_I] (index_rope "none": x itself)."""
        cfg = self.cfg
        if cfg.index_rope == "none":
            return x
        r = cfg.qk_rope_dim
        return torch.cat([apply_rope(x[..., :r], positions, cfg.index_rope, self.rotary), x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, d] (rows padded), positions [R] -> (key bytes [R, d_I] uint8 (fp32: [R, 4 d_I]), scale [R])."""
        k = self._rope(self.k_norm(self.wk(x)), positions)
        if self.is_exact:
            return k.contiguous().view(torch.uint8), torch.ones(k.shape[0])
        return fp8_quantize_rowwise(k @ self.hadamard)

    def queries(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None = None) -> IndexQueries:
        """qr [R, q_lora] (the MLA query latent), x [R, d], positions [R] -> IndexQueries for R rows."""
        num_rows = x.shape[0]
        q = self._rope(self.wq(qr).view(num_rows, self.num_heads, self.head_dim), positions)
        const = (self.num_heads * self.head_dim) ** -0.5
        if self.is_exact:
            return IndexQueries(q=q, weights=self.w_proj(x) * const)
        q_bytes, q_scale = fp8_quantize_rowwise(q @ self.hadamard)
        weights = self.w_proj(x) * const * q_scale
        return IndexQueries(q=fp8_to_float(q_bytes), weights=weights)


def model_rotary(cfg: ModelConfig) -> Rotary:
    """The model's rotary embedding (MLA and indexer share it), from the rope_* fields of its config."""
    attention_factor = 1.0
    if cfg.rope_factor > 1:
        attention_factor = yarn_mscale(cfg.rope_factor, cfg.rope_mscale)
        if cfg.rope_mscale_all_dim:
            attention_factor /= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return Rotary(cfg.rope_theta, cfg.rope_factor, cfg.rope_original_context, cfg.rope_beta_fast, cfg.rope_beta_slow,
                  attention_factor)


def index_keys_to_float(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """Cached index-key value bytes [..., d_I] (fp8) or [..., 4 d_I] (fp32) -> float32 values [..., d_I]."""
    return raw.contiguous().view(torch.float32) if fmt == "fp32" else fp8_to_float(raw)


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor
) -> torch.Tensor:
    """Scores [T, L] of T queries against L keys. q [T,H,D] fp8-valued, weights [T,H], keys [L,D] fp8-valued."""
    dots = torch.matmul(q.double(), keys.double().t()).to(torch.float32)  # [T, H, L], exact before rounding
    dots.relu_().mul_(weights.unsqueeze(-1))
    total = dots[:, 0] + dots[:, 1] if q.shape[1] > 1 else dots[:, 0].clone()
    for h in range(2, q.shape[1]):  # fixed head order
        total.add_(dots[:, h])
    return total.mul_(key_scale)


def select_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Stable causal top-k. scores [T, L] over keys 0..L-1, positions [T] -> [T, topk] ascending ids, -1 padded.

    Keeps the topk highest scores among keys s <= position; equal scores go to the lower position.
    Queries with position + 1 <= topk keep every earlier key without looking at the scores.
    """
    num_q, num_keys = scores.shape
    slots = torch.arange(topk)
    out = torch.where(slots.unsqueeze(0) <= positions.unsqueeze(1), slots.unsqueeze(0), torch.full((), -1))
    full = (positions + 1 > topk).nonzero().squeeze(1)
    if full.numel() == 0:
        return out
    pos = positions[full]
    masked = scores[full].masked_fill_(torch.arange(num_keys).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
    thresh = torch.topk(masked, topk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    take = masked > thresh
    equal = masked == thresh
    need = topk - take.sum(-1, keepdim=True)
    excess = (equal.sum(-1, keepdim=True) > need).squeeze(1)
    if bool(excess.any()):  # more ties at the threshold than slots: the lower positions win
        rows = excess.nonzero().squeeze(1)
        eq = equal[rows]
        take[rows] |= eq & (torch.cumsum(eq, -1) <= need[rows])
        keep_all = ~excess
        take[keep_all] |= equal[keep_all]
    else:
        take |= equal
    out[full] = take.nonzero()[:, 1].view(-1, topk)
    return out


def naive_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor
) -> torch.Tensor:
    """Reference: the whole formula in float64 with einsum, rounded to fp32 once at the end."""
    dots = torch.einsum("thd,ld->thl", q.double(), keys.double()).clamp_min(0)
    total = torch.einsum("thl,th->tl", dots, weights.double()) * key_scale.double()
    return total.to(torch.float32)


def naive_select_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Reference: per query, a stable descending sort over keys 0..pos, first topk, re-sorted ascending."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64)
    for i, pos in enumerate(positions.tolist()):
        row = scores[i, : pos + 1]
        order = torch.sort(row, descending=True, stable=True).indices[:topk]
        chosen = torch.sort(order).values
        out[i, : chosen.numel()] = chosen
    return out
