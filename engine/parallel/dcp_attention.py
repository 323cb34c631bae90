"""Partial attention over a rank's owned selected tokens, and the LSE merge of partial outputs.

Absorbed-MLA (MQA) form: every query head scores the same gathered cache rows. A rank computes, per
query row and head, the softmax-normalised output over its own selected rows and the log-sum-exp of the
scaled scores; an empty selection gives lse = -inf and a zero output. The merge:
M = max_r lse_r, a_r = exp(lse_r - M), o = sum_r a_r o_r / sum_r a_r, lse = M + log sum_r a_r, summed in
ascending rank order on every rank (the gather moves data only; no cross-rank reduction tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.comm import all_gather_stack
from engine.parallel.groups import ParallelContext


@dataclass(frozen=True)
class PartialAttention:
    """One rank's share of attention for a batch of query rows."""

    out: torch.Tensor   # [B, H, Dv] fp32, normalised over this rank's keys (0 where it has none)
    lse: torch.Tensor   # [B, H] fp32 natural-log sum of exp(scaled scores); -inf where no keys


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> PartialAttention:
    """q [B, H, D], keys [B, n, D], values [B, n, Dv], mask [B, n] bool (True = attend)."""
    scores = torch.einsum("bhd,bnd->bhn", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # [B, H]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])                            # exp(-inf) = 0
    out = torch.einsum("bhn,bnv->bhv", probs, values.float())
    out = torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out))
    return PartialAttention(out=out, lse=torch.where(torch.isfinite(lse), lse, float("-inf")))


def lse_merge(outs: torch.Tensor, lses: torch.Tensor) -> PartialAttention:
    """Merge [W, B, H, Dv] partial outputs with [W, B, H] LSEs in ascending index order."""
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    top = lses.max(dim=0).values
    safe_top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    num = torch.zeros_like(outs[0])
    den = torch.zeros_like(lses[0])
    for r in range(outs.shape[0]):
        weight = torch.exp(lses[r] - safe_top)                             # 0 where lse_r = -inf
        num = num + torch.where(weight[..., None] > 0, weight[..., None] * outs[r], 0.0)
        den = den + weight
    out = torch.where(den[..., None] > 0, num / den.clamp(min=1e-38)[..., None], 0.0)
    lse = torch.where(den > 0, safe_top + torch.log(den.clamp(min=1e-38)), float("-inf"))
    return PartialAttention(out=out, lse=lse)


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> PartialAttention:
    """Single-pass reference over all keys at once (the oracle for partial + merge)."""
    return partial_attention(q, keys, values, mask, scale)


def dcp_combine(ctx: ParallelContext, part: PartialAttention) -> PartialAttention:
    """All-gather every rank's partial result and merge in rank order (identical on every rank)."""
    if ctx.is_single:
        return part
    return lse_merge(all_gather_stack(ctx, part.out), all_gather_stack(ctx, part.lse))
