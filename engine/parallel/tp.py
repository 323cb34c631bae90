"""Expert parallelism of the MoE layers over a rank group (gpt-fast style: the model never knows).

`apply_tp(model, ctx)` makes every MoE expert-parallel, bit-identical to the single-rank model, by moving data
and never partial sums. Rank r holds experts [r*E/W, (r+1)*E/W) only: a rank's shard of the model
(engine/model/shards.py) was built with just those (the fast steps copy the same shard); a whole model keeps
copies of them. Each rank routes its own rows, sends each row's latent z to the ranks owning its chosen experts
(all_to_all), every owner runs its experts on the rows it received (padded to the row block, so each row's
result does not depend on its neighbours), and the per-slot expert outputs travel back (all_to_all). Every
(row, slot) output comes from exactly one rank, so the combine selects rather than sums, and then adds the slots
in ascending expert id as `MoE.forward` does. The head-sharded MLA and KDA weights are run by the parallel
prefill and decode (engine/parallel/prefill.py, sharded.py). World size 1 leaves the model untouched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.model import KimiModel
from engine.model.moe import MoE
from engine.model.numerics import ROW_BLOCK, pad_rows
from engine.parallel.comm import all_gather_stack, all_to_all_list
from engine.parallel.groups import ParallelContext


class ExpertParallelMoE(nn.Module):
    """A MoE whose routed experts are split over the ranks of `ctx`; forward is collective (SPMD)."""

    def __init__(self, moe: MoE, ctx: ParallelContext) -> None:
        super().__init__()
        cfg = moe.cfg
        if cfg.num_experts % ctx.world_size:
            raise ValueError(f"{cfg.num_experts} experts do not split over {ctx.world_size} ranks")
        self.cfg, self.ctx = cfg, ctx
        self.per_rank = cfg.num_experts // ctx.world_size
        self.first = ctx.rank * self.per_rank
        self.router, self.correction_bias = moe.router, moe.correction_bias
        self.w_down_latent, self.latent_norm, self.w_up_latent = moe.w_down_latent, moe.latent_norm, moe.w_up_latent
        if moe.is_whole:  # a whole MoE (a replica the fast kernels also run): keep copies of this rank's experts
            own = slice(self.first, self.first + self.per_rank)
            self.w1 = nn.Parameter(moe.w1[own].clone(), requires_grad=False)
            self.w3 = nn.Parameter(moe.w3[own].clone(), requires_grad=False)
            self.w2 = nn.Parameter(moe.w2[own].clone(), requires_grad=False)
        elif moe.expert_lo != self.first or moe.w1.shape[0] != self.per_rank:
            raise ValueError(f"rank {ctx.rank} of {ctx.world_size} holds experts from {moe.expert_lo}, not its own")
        else:  # the rank's shard: its experts are all it holds
            self.w1, self.w3, self.w2 = moe.w1, moe.w3, moe.w2
        self.shared = moe.shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The single-device routing code, run on this module's (shared) router weights."""
        return MoE.route(self, x)  # type: ignore[arg-type]

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        assert z.shape[0] % ROW_BLOCK == 0
        j = e - self.first
        return (F.silu(z @ self.w1[j].t()) * (z @ self.w3[j].t())) @ self.w2[j].t()

    def _run_experts(self, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows received from every rank: z [n, lat], ids [n, k] -> outputs [n, k, lat] for owned slots."""
        out = z.new_zeros(ids.shape[0], ids.shape[1], z.shape[1])
        owned = (ids >= self.first) & (ids < self.first + self.per_rank)
        for e in torch.unique(ids[owned]).tolist():
            rows, cols = (ids == e).nonzero(as_tuple=True)
            out[rows, cols] = self.expert(e, pad_rows(z[rows]))[: rows.shape[0]]
        return out

    def forward(self, x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        num_rows = x.shape[0] if num_rows is None else num_rows
        ids, weights = self.route(x)
        ids, weights = ids[:num_rows], weights[:num_rows]
        z = MoE.to_experts(self, x)[:num_rows]  # type: ignore[arg-type]
        owner = ids // self.per_rank                                           # [n, k]
        world = self.ctx.world_size
        wanted = [(owner == r).any(1).nonzero().flatten() for r in range(world)]
        payload = [torch.cat([z[rows], ids[rows].float()], dim=1) for rows in wanted]
        received = all_to_all_list(self.ctx, payload)
        lat = z.shape[1]
        results = [self._run_experts(p[:, :lat], p[:, lat:].long()) for p in received]
        returned = all_to_all_list(self.ctx, results)
        slots = z.new_zeros(num_rows, ids.shape[1], lat)
        for r, rows in enumerate(wanted):
            mine = owner[rows] == r
            slots[rows] = torch.where(mine[..., None], returned[r], slots[rows])
        return self._finish(x, slots, weights, num_rows)

    def forward_replicated(self, x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """`forward` for rows every rank holds alike (a decode step): each rank runs its experts on the (row, slot)
        pairs it owns, and one all-gather of the per-slot outputs [n, k, lat] lets every rank take each pair's
        output from its owner; no pair runs twice (the all-to-alls of `forward` would run each once per rank)."""
        num_rows = x.shape[0] if num_rows is None else num_rows
        ids, weights = self.route(x)
        ids, weights = ids[:num_rows], weights[:num_rows]
        z = MoE.to_experts(self, x)[:num_rows]  # type: ignore[arg-type]
        every = all_gather_stack(self.ctx, self._run_experts(z, ids))          # [W, n, k, lat]
        owner = (ids // self.per_rank)[None, :, :, None].expand(1, -1, -1, z.shape[1])
        return self._finish(x, every.gather(0, owner)[0], weights, num_rows)

    def _finish(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Mix the slots' outputs [n, k, lat] in slot order (as `MoE.forward`), then the latent up-projection and
        the shared expert."""
        mixed = slots[:, 0] * weights[:, 0:1]
        for j in range(1, slots.shape[1]):
            mixed = mixed + slots[:, j] * weights[:, j : j + 1]
        full = x.new_zeros(x.shape[0], slots.shape[2])
        full[:num_rows] = mixed
        return MoE.from_experts(self, full, x)  # type: ignore[arg-type]


def replicated_rows_ffn(ffn: nn.Module, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A layer's FFN on rows every rank holds alike (`KimiModel.run_layers`' `ffn` for the decode paths)."""
    return ffn.forward_replicated(h, num_rows) if isinstance(ffn, ExpertParallelMoE) else ffn(h, num_rows)


def apply_tp(model: KimiModel, ctx: ParallelContext) -> KimiModel:
    """Run the model's MoE layers expert-parallel over `ctx` (in place; see module docstring) and return it."""
    if ctx.is_single:
        return model
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            layer.ffn = ExpertParallelMoE(layer.ffn, ctx)
    return model
