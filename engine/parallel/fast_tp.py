"""The fast decode step (engine/fast/decoder.py) inside the TP decode: W ranks, one batch, SPMD.

`TPFastDecoder(model, layout, ctx)` is a `FastDecoder` whose step every rank of `ctx` runs on the same batch (the
rows are replicated, as in the reference TP decode, engine/parallel/dcp_decode.py), splitting what the
reference TP splits:
- MLA + DSA indexer: replicated. Every rank holds the whole attention rows of its requests (the TP pool
  replicates the latent) and runs the single-rank fast MLA step (`FastDecoder._mla`).
- KDA: heads sharded as engine/parallel/kda_shard.py shards them for the reference: rank r owns heads
  [r*H/W, (r+1)*H/W) and its pool's KDA rows hold only those heads (layout tp_size = W). The rank's copies of the
  head-wise projections (w_fb, w_b, w_qkv rows, the gate rate and bias, the conv taps) are sliced to its heads,
  so the fast conv and recurrent kernels run on the rank's KDA rows unchanged; one all-gather of o [B, H/W, d]
  restores every head before the output norm, gate and projection, which run whole on every rank.
- MoE: expert parallel. Rank r keeps experts [r*E/W, (r+1)*E/W) (bf16 copies of those only). The rows are
  replicated, so every rank already holds every row's routing and latent z: each rank runs its experts on the
  (row, slot) pairs they own - few pairs: each pair reads its own expert in place (`expert_gemv`), else batched
  GEMMs over the rank's experts - and one all-gather of the per-slot outputs [B, k, lat] lets every rank select
  each (row, slot) output from its owner's share, then mix the slots in ascending slot order, as
  engine/parallel/tp.py `ExpertParallelMoE` combines. (That module's all_to_all of the latents to the owners
  suits rows that differ per rank; with replicated rows it would run each pair once per rank.)
  Shared expert, latent projections and router run whole on every rank.
Token-wise linears run with their full weights on every rank (no cross-rank partial sums), so every rank ends
the step with the same logits. The step synchronises with the host (which pairs a rank owns): it is not
captured into CUDA graphs. World size 1 is the single-rank FastDecoder's step with the MoE through the same
code (a no-op gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.fast.decoder import BF16, FastDecoder
from engine.fast.expert_gemv import expert_gemv
from engine.layout import RowLayout
from engine.model.kda import KDA
from engine.model.model import KimiModel
from engine.parallel.comm import all_gather_stack
from engine.parallel.groups import ParallelContext
from engine.parallel.kda_shard import head_range, qkv_channels


def _moe_local_experts(z: torch.Tensor, local: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """Every expert of this rank on every (row, slot) pair it owns, then each pair's own: z [m, lat] (one row per
    pair), local [m] (the pair's expert among this rank's) -> [m, lat] fp32."""
    experts = w1.shape[0]
    zb = z.unsqueeze(0).expand(experts, -1, -1)  # [E/W, m, lat]
    hidden = F.silu(torch.bmm(zb, w1.transpose(1, 2))) * torch.bmm(zb, w3.transpose(1, 2))
    out = torch.bmm(hidden, w2.transpose(1, 2))  # [E/W, m, lat]
    return out[local, torch.arange(z.shape[0], device=z.device)].float()


class TPFastDecoder(FastDecoder):
    PARALLELISM = "tp"  # its MoE and KDA sharding implement the presets' semantics only (engine/fast/support.py)

    def __init__(self, model: KimiModel, layout: RowLayout, ctx: ParallelContext, dtype: torch.dtype = BF16,
                 compile: bool = False) -> None:
        cfg = model.cfg
        world = ctx.world_size
        if cfg.num_experts % world:
            raise ValueError(f"{cfg.num_experts} experts do not split over {world} ranks")
        if layout.kda_heads_per_gpu * world != cfg.kda_num_heads:
            raise ValueError(f"the pool's KDA rows hold {layout.kda_heads_per_gpu} heads; {world} TP ranks own "
                             f"{cfg.kda_num_heads // world} each (plan the layout with tp_size={world})")
        self.ctx = ctx
        self.heads = head_range(cfg, world, ctx.rank)
        self.per_rank = cfg.num_experts // world
        self.first = ctx.rank * self.per_rank
        super().__init__(model, layout, dtype, compile)
        local = torch.compile(_moe_local_experts, dynamic=True) if compile else _moe_local_experts
        self._seg["_moe_local_experts"] = local
        own = slice(self.first, self.first + self.per_rank)
        for layer in self.layers:
            if not layer.dense:  # keep only this rank's experts (clone: drop the full copies)
                for name in ("w1", "w3", "w2"):
                    layer.ffn[name] = layer.ffn[name][own].clone()

    def _kda_weights(self, kda: KDA, norm: torch.Tensor) -> dict[str, Any]:
        """The single-rank weights with the head-wise projections cut to this rank's heads."""
        lo, hi = self.heads
        d = kda.head_dim
        span = slice(lo * d, hi * d)
        channels = qkv_channels(self.cfg, lo, hi).to(kda.w_qkv.weight.device)
        return self._kda_pack(kda, norm, kda.w_fb.weight[span], torch.exp(kda.A_log[lo:hi]).repeat_interleave(d),
                              kda.dt_bias[span], kda.w_b.weight[lo:hi], kda.w_qkv.weight[channels],
                              kda.conv_weight[channels], hi - lo)

    def _all_heads(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, H/W, d] of this rank's heads -> [B, H, d] (one all-gather, heads in rank order)."""
        batch = o.shape[0]
        return all_gather_stack(self.ctx, o).permute(1, 0, 2, 3).reshape(batch, self.cfg.kda_num_heads, -1)

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
