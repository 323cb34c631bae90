"""The fast decode step (engine/fast/decoder.py) inside the TP decode: W ranks, one batch, SPMD, each rank on its
shard of the weights (engine/model/shards.py: its MLA heads, KDA heads, experts and d_model/W output rows).

`TPFastDecoder(model, layout, ctx)` takes the rank's shard (`build_model(cfg, shard=ShardSpec(W, rank))`; at W = 1
the whole model) and makes bf16 copies of what it holds, so a rank never holds a whole sharded tensor. Every rank
runs the step on the same batch (the rows are replicated, as in the reference TP decode,
engine/parallel/dcp_decode.py) and splits what the reference splits (engine/parallel/sharded.py):
- MLA + DSA indexer: the indexer's weights are whole, so every rank selects the same keys from its replicated
  attention rows; the rank computes its heads' absorbed queries and runs the sparse MLA kernel for those heads
  only (nothing crosses ranks before the attention), then W_UV and the gate on its heads (`_mla_values`);
- KDA: rank r owns heads [r*H/W, (r+1)*H/W) and its pool's KDA rows hold only those (layout tp_size = W). The
  shard's w_qkv, conv taps, w_g and w_fb are those heads'; the whole w_b, A_log and dt_bias are cut to them here;
  the conv and recurrent kernels run on the rank's rows unchanged, then the per-head norm and the gate
  (`_kda_values`);
- output projections (`_output_rows`): the gated values of the rank's heads [B, h*v] are all-gathered into
  every head's [B, H*v], the rank computes its d_model/W output features with its rows of wo (full-length dot
  products, no partial sum crosses ranks) and one all-gather assembles [B, d_model];
- MoE: expert parallel. The shard holds experts [r*E/W, (r+1)*E/W). The rows are replicated, so every rank
  already holds every row's routing and latent z: each rank runs its experts on the (row, slot) pairs they own -
  few pairs: each pair reads its own expert in place (`expert_gemv`), else batched GEMMs over the rank's experts -
  and one all-gather of the per-slot outputs [B, k, lat] lets every rank select each (row, slot) output from its
  owner's share, then mix the slots in ascending slot order, as engine/parallel/tp.py `ExpertParallelMoE`
  combines. Shared expert, latent projections and router run whole on every rank.
Every rank ends the step with the same logits (bitwise: each value is computed on one rank and moved). Against the
single-rank FastDecoder the step is equal within fp32 rounding, not bitwise: the attention kernel runs H/W heads
(another split choice), the KDA front GEMMs N = H/W-wide slices (tests/engine/fast/test_tp_decode.py states the
bound). The step synchronises with the host (which pairs a rank owns): it is not captured into CUDA graphs. World
size 1 is the single-rank FastDecoder's step with the MoE through the same code (the gathers return their input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.fast.decoder import BF16, FastDecoder, _lin
from engine.fast.expert_gemv import expert_gemv
from engine.fast.mla import merge_splits
from engine.fast.pages import PageBatch
from engine.layout import RowLayout
from engine.model.kda import KDA
from engine.model.model import KimiModel
from engine.model.numerics import rms_norm
from engine.parallel.comm import all_gather_stack
from engine.parallel.groups import ParallelContext
from engine.parallel.kda_shard import head_range
from engine.parallel.sharded import all_heads, check_shard


def _moe_local_experts(z: torch.Tensor, local: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """Every expert of this rank on every (row, slot) pair it owns, then each pair's own: z [m, lat] (one row per
    pair), local [m] (the pair's expert among this rank's) -> [m, lat] fp32."""
    experts = w1.shape[0]
    zb = z.unsqueeze(0).expand(experts, -1, -1)  # [E/W, m, lat]
    hidden = F.silu(torch.bmm(zb, w1.transpose(1, 2))) * torch.bmm(zb, w3.transpose(1, 2))
    out = torch.bmm(hidden, w2.transpose(1, 2))  # [E/W, m, lat]
    return out[local, torch.arange(z.shape[0], device=z.device)].float()


def _mla_values(gate: torch.Tensor | None, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """W_UV and the output gate on this rank's heads: o^lat [B, h, kv_lora] fp32 -> gated values [B, h*v]."""
    o = torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv)  # [h, B, v]
    o = o.transpose(0, 1).reshape(o_lat.shape[0], -1)
    return o if gate is None else o * gate.to(o.dtype)


def _mla_values_splits(gate: torch.Tensor | None, partial: torch.Tensor, lse: torch.Tensor, latent_scale: float,
                       w_uv: torch.Tensor) -> torch.Tensor:
    """`_mla_values` of the sparse MLA's unmerged splits (their merge fuses into this segment's kernels)."""
    return _mla_values(gate, merge_splits(partial, lse, latent_scale), w_uv)


def _kda_values(gate: torch.Tensor, o: torch.Tensor, o_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head output norm and the gate on this rank's KDA heads: o [B, h, d] -> [B, h*d]."""
    return rms_norm(o, o_norm, eps).reshape(o.shape[0], -1) * gate


def _out_rows(values: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """Every head's gated values [B, H*v] -> this rank's output features [B, d_model/W] fp32 (its rows of wo)."""
    return _lin(values, wo).float()


SHARD_SEGMENTS = ("_mla_values", "_mla_values_splits", "_kda_values", "_out_rows", "_moe_local_experts")
"""The torch segments of the sharded step beside FastDecoder's (compiled with them when `compile`)."""


class TPFastDecoder(FastDecoder):
    PARALLELISM = "tp"  # its MoE and KDA sharding implement the presets' semantics only (engine/fast/support.py)

    def __init__(self, model: KimiModel, layout: RowLayout, ctx: ParallelContext, dtype: torch.dtype = BF16,
                 compile: bool = False) -> None:
        """`model`: this rank's shard of the model (`ShardSpec(ctx.world_size, ctx.rank)`; whole at W = 1)."""
        cfg = model.cfg
        world = ctx.world_size
        check_shard(ctx, model)
        if layout.kda_heads_per_gpu * world != cfg.kda_num_heads:
            raise ValueError(f"the pool's KDA rows hold {layout.kda_heads_per_gpu} heads; {world} TP ranks own "
                             f"{cfg.kda_num_heads // world} each (plan the layout with tp_size={world})")
        self.ctx = ctx
        self.heads = head_range(cfg, world, ctx.rank)
        self.per_rank = cfg.num_experts // world
        self.first = ctx.rank * self.per_rank
        super().__init__(model, layout, dtype, compile)
        shard_segments = {name: globals()[name] for name in SHARD_SEGMENTS}
        if compile:
            shard_segments = {name: torch.compile(fn, dynamic=True) for name, fn in shard_segments.items()}
        self._seg.update(shard_segments)

    def _kda_weights(self, kda: KDA, norm: torch.Tensor) -> dict[str, Any]:
        """The shard's KDA tensors (its heads' w_qkv, conv taps, w_g, w_fb) with the whole per-head scalars
        (w_b, A_log, dt_bias) cut to this rank's heads."""
        lo, hi = self.heads
        d = kda.head_dim
        if (kda.head_lo, kda.num_heads) != (lo, hi - lo):
            raise ValueError(f"the KDA layer holds heads from {kda.head_lo}, this rank owns [{lo}, {hi})")
        span = slice(lo * d, hi * d)
        return self._kda_pack(kda, norm, kda.w_fb.weight, torch.exp(kda.A_log[lo:hi]).repeat_interleave(d),
                              kda.dt_bias[span], kda.w_b.weight[lo:hi], kda.w_qkv.weight, kda.conv_weight, hi - lo)

    def _output_rows(self, x: torch.Tensor, values: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
        """x + W_O(every head's values): this rank's heads' gated values [B, h*v] all-gathered over the heads, its
        output rows of wo, the output features all-gathered (module docstring)."""
        mine = self._seg["_out_rows"](all_heads(self.ctx, values), wo)  # [B, d/W]
        return x + all_heads(self.ctx, mine)

    def _mla(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
             index: int) -> torch.Tensor:
        gate, partial, lse = self._mla_splits(m, x, buffer, pages, index)  # this rank's heads
        values = self._seg["_mla_values_splits"](gate, partial, lse, m["latent_scale"], m["w_uv"])
        return self._output_rows(x, values, m["wo"])

    def _kda(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
             index: int) -> torch.Tensor:
        gate, o = self._kda_heads(m, x, buffer, pages, index)
        return self._output_rows(x, self._seg["_kda_values"](gate, o, m["o_norm"], self.cfg.rms_eps), m["wo"])

    def _moe(self, f: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        cfg, seg, ctx = self.cfg, self._seg, self.ctx
        shared, ids, weights, z = seg["_moe_route"](x, f["norm"], f["router"], f["bias"], f["w_h"], cfg.rms_eps,
                                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor, f["latent"])
        batch, top_k = ids.shape
        own = self._run_experts(z, ids, f)  # [B, k, lat] fp32: this rank's pairs, zeros elsewhere
        gathered = all_gather_stack(ctx, own)  # [W, B, k, lat]
        owner = (ids // self.per_rank).view(1, batch, top_k, 1).expand(1, batch, top_k, own.shape[2])
        slots = gathered.gather(0, owner).squeeze(0)  # each (row, slot) from the rank owning its expert
        mixed = slots[:, 0] * weights[:, 0:1]
        for j in range(1, top_k):
            mixed = mixed + slots[:, j] * weights[:, j : j + 1]
        return seg["_moe_out"](x, shared, mixed, None, f["latent_norm"], f["w_up_latent"], f["shared_down"],
                               cfg.rms_eps)

    def _run_experts(self, z: torch.Tensor, ids: torch.Tensor, f: dict[str, Any]) -> torch.Tensor:
        """z [n, lat], ids [n, k] -> [n, k, lat] fp32: the outputs of the (row, slot) pairs whose expert is this
        rank's (zeros elsewhere)."""
        out = torch.zeros(ids.shape[0], ids.shape[1], z.shape[1], dtype=torch.float32, device=z.device)
        owned = (ids >= self.first) & (ids < self.first + self.per_rank)
        rows, cols = owned.nonzero(as_tuple=True)
        pairs = rows.shape[0]
        if pairs == 0:
            return out
        local = ids[rows, cols] - self.first
        if pairs < self.per_rank and self.dtype == BF16:  # few pairs: each reads its own expert in place
            got = expert_gemv(z[rows], local[:, None], f["w1"], f["w3"], f["w2"])[:, 0].float()
        else:
            got = self._seg["_moe_local_experts"](z[rows], local, f["w1"], f["w3"], f["w2"])
        out[rows, cols] = got
        return out
