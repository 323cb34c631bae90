"""Feed-forward blocks: the dense SiLU-GLU MLP and the latent MoE with a sigmoid router and correction bias.

MoE (SiLU-GLU experts stand in for K3's SiTU/clipup):
    s = sigmoid(W_r x);  Sel = top-k(s + correction_bias) (stable: ties to the lower expert id)
    w_e = s_e / sum_{Sel} s * routed_scaling_factor    (the bias only picks experts, it never weighs them;
                                                        moe_renormalize false: w_e = s_e * routed_scaling_factor)
    z = W_down x;  y = W_up(RMSNorm(sum_{e in Sel, ascending e} w_e * expert_e(z))) + shared(x)
    (moe_latent_dim 0, Kimi-Linear / DeepSeek: z = x and y = sum_e w_e * expert_e(x) + shared(x))
Grouped top-k (num_expert_groups G > 1, DeepSeek's noaux_tc): the experts form G equal groups; a group scores the
sum of its two best biased scores; only the topk_groups best groups (stable: ties to the lower group) may be chosen.
Batch invariance: each expert runs on its gathered tokens padded to a multiple of 16 rows (numerics.ROW_BLOCK), and the chosen experts'
outputs are added in ascending expert id, so a token's output does not depend on the other tokens in its batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.config import ModelConfig
from engine.model.numerics import ROW_BLOCK, RMSNorm, RowLinear, pad_rows
from engine.model.shards import WHOLE, ShardSpec


class DenseMLP(nn.Module):
    """SiLU-GLU: W_down(silu(W_gate x) * W_up x)."""

    def __init__(self, d_model: int, intermediate: int) -> None:
        super().__init__()
        self.w_gate = RowLinear(d_model, intermediate)
        self.w_up = RowLinear(d_model, intermediate)
        self.w_down = RowLinear(intermediate, d_model)

    def forward(self, x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """The MoE block. Built with a `ShardSpec` of W ranks it holds routed experts [expert_lo, expert_lo + E/W) only
    (w1, w3, w2; engine/model/shards.py) and `forward` refuses to run: the expert-parallel wrapper
    (engine/parallel/tp.py) routes each pair to its owner."""

    def __init__(self, cfg: ModelConfig, shard: ShardSpec = WHOLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.expert_lo, expert_hi = shard.split(cfg.num_experts, "routed experts")
        self.is_whole = shard.is_whole
        e, lat, inter = expert_hi - self.expert_lo, cfg.moe_latent_dim, cfg.moe_intermediate
        self.router = RowLinear(cfg.d_model, cfg.num_experts)
        self.correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.w_down_latent = RowLinear(cfg.d_model, lat) if lat else None
        self.latent_norm = RMSNorm(lat, cfg.rms_eps) if lat else None
        self.w_up_latent = RowLinear(lat, cfg.d_model) if lat else None
        lat = lat or cfg.d_model
        self.w1 = nn.Parameter(torch.empty(e, inter, lat), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, inter, lat), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, lat, inter), requires_grad=False)
        self.shared = DenseMLP(cfg.d_model, cfg.shared_intermediate) if cfg.num_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, d] -> (expert ids [R, k] ascending, weights [R, k])."""
        cfg = self.cfg
        scores = torch.sigmoid(self.router(x))
        biased = scores + self.correction_bias
        if cfg.num_expert_groups > 1:
            biased = mask_groups(biased, cfg.num_expert_groups, cfg.topk_groups)
        order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
        ids = torch.sort(order[:, : cfg.num_experts_per_tok], dim=-1).values
        picked = scores.gather(1, ids)
        if not cfg.moe_renormalize:
            return ids, picked * cfg.routed_scaling_factor
        total = picked[:, 0]
        for j in range(1, picked.shape[1]):
            total = total + picked[:, j]
        return ids, picked / total.unsqueeze(1) * cfg.routed_scaling_factor

    def to_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' input rows: z = W_down x (latent MoE) or x."""
        return self.w_down_latent(x) if self.w_down_latent is not None else x

    def from_experts(self, mixed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """mixed [R, latent or d] (padded rows) -> the layer output: W_up RMSNorm (latent MoE) + shared(x)."""
        out = self.w_up_latent(self.latent_norm(mixed)) if self.w_up_latent is not None else mixed
        return out + self.shared(x) if self.shared is not None else out

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """One routed expert on z [n, latent] (n a multiple of 64)."""
        assert z.shape[0] % ROW_BLOCK == 0
        j = e - self.expert_lo
        hidden = F.silu(z @ self.w1[j].t()) * (z @ self.w3[j].t())
        return hidden @ self.w2[j].t()

    def forward(self, x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """x [R, d] (padded rows); only the first num_rows rows are routed (the rest yield the shared part only)."""
        if not self.is_whole:
            raise RuntimeError("a MoE holding only its rank's experts runs through the expert-parallel wrapper")
        num_rows = x.shape[0] if num_rows is None else num_rows
        ids, weights = self.route(x)
        ids, weights = ids[:num_rows], weights[:num_rows]
        z = self.to_experts(x)
        slots = torch.zeros(num_rows, ids.shape[1], z.shape[1])
        for e in torch.unique(ids).tolist():
            rows, cols = (ids == e).nonzero(as_tuple=True)
            slots[rows, cols] = self.expert(e, pad_rows(z[rows]))[: rows.shape[0]]
        mixed = slots[:, 0] * weights[:, 0:1]
        for j in range(1, ids.shape[1]):
            mixed = mixed + slots[:, j] * weights[:, j : j + 1]
        full = x.new_zeros(x.shape[0], z.shape[1])
        full[:num_rows] = mixed
        return self.from_experts(full, x)


def mask_groups(biased: torch.Tensor, num_groups: int, keep: int) -> torch.Tensor:
    """Grouped top-k: biased scores [R, E] with every expert outside the `keep` best of `num_groups` groups set
    to -inf (a group's score: the sum of its two best; ties to the lower group)."""
    rows, experts = biased.shape
    grouped = biased.view(rows, num_groups, experts // num_groups)
    best = torch.topk(grouped, 2, dim=-1).values
    group_scores = best[..., 0] + best[..., 1]
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    allowed = torch.zeros(rows, num_groups, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(rows, experts)


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Reference: one token at a time, float64, experts chosen by a plain stable sort."""
    cfg = moe.cfg
    out = torch.zeros(x.shape[0], cfg.d_model, dtype=torch.float64)
    params = {name: p.double() for name, p in moe.named_parameters()}
    group_size = cfg.num_experts // cfg.num_expert_groups
    for t in range(x.shape[0]):
        xt = x[t].double()
        scores = torch.sigmoid(params["router.weight"] @ xt)
        biased = scores + params["correction_bias"]
        groups = [sorted(biased[g * group_size:(g + 1) * group_size].tolist(), reverse=True)[:2]
                  for g in range(cfg.num_expert_groups)]
        ranked = sorted(range(cfg.num_expert_groups), key=lambda g: -sum(groups[g]))[: cfg.topk_groups]
        allowed = [e for e in range(cfg.num_experts) if e // group_size in ranked]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[: cfg.num_experts_per_tok]
        z = params["w_down_latent.weight"] @ xt if cfg.moe_latent_dim else xt
        acc = torch.zeros(z.shape[0], dtype=torch.float64)
        norm = scores[chosen].sum() if cfg.moe_renormalize else 1.0
        for e in chosen:
            hidden = F.silu(params["w1"][e] @ z) * (params["w3"][e] @ z)
            acc += scores[e] / norm * cfg.routed_scaling_factor * (params["w2"][e] @ hidden)
        if cfg.moe_latent_dim:
            acc = acc * torch.rsqrt(acc.pow(2).mean() + cfg.rms_eps) * params["latent_norm.weight"]
            acc = params["w_up_latent.weight"] @ acc
        out[t] = acc
        if moe.shared is not None:
            g = F.silu(params["shared.w_gate.weight"] @ xt) * (params["shared.w_up.weight"] @ xt)
            out[t] += params["shared.w_down.weight"] @ g
    return out.to(torch.float32)
