"""The fast decode step (engine/fast/decoder.py) inside the DCP decode: W ranks, the cache split by token, SPMD.

`DCPFastDecoder(model, layout, ctx)` is the TP fast decoder on the rank's shard of the weights
(engine/parallel/fast_tp.py: token-wise work on the replicated rows, the rank's MLA and KDA heads, its output rows
of wo, MoE expert-parallel) whose MLA step attends over a cache split by token as the reference DCP decode splits
it (engine/parallel/dcp_decode.py, `attention="lse"`):
- the rank computes its heads' absorbed queries and one all-gather gives every rank every head's (a rank scores
  its own tokens for all heads);
- the pool is a DCP rank's (layout dcp_size = W): a request's rows hold the rank's owned tokens in order
  (engine/parallel/dcp_layout.py: aligned runs of `interleave` tokens round-robin over the ranks), so the fast
  kernels address them with local token indices, unchanged;
- the new token's latent and index key are written by the rank that owns its position only
  (`PageBatch.write_positions`, -1 elsewhere);
- each rank scores its owned index keys in-kernel (`indexer.index_scores`, -inf past its last owned token);
  the exact compact top-k merge (engine/parallel/dcp_merge.py) gives every rank the global top-k's keys that
  it owns;
- each rank runs the sparse MLA kernel over those keys (absorbed form, splits merged with their log-sum-exp:
  `mla.merge_splits_lse`) and the partial outputs are merged by log-sum-exp in rank order
  (`dcp_attention.dcp_combine`), so every rank ends the step with the same o^lat and the same logits;
- W_UV and the gate on the rank's heads, then the output rows as in the TP step (`_output_rows`).
The reference DCP's `attention="exact"` (every selected latent gathered so that the logits equal one rank's bit
for bit) has no fast form: the fast kernels are not bit-equal to the reference anyway (docs/ARCHITECTURE.md).
The step synchronises with the host (the top-k merge and the expert ownership), so it is not graph-captured.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.fast.decoder import FastDecoder
from engine.fast.indexer import index_scores
from engine.fast.mla import merge_splits_lse, sparse_mla_decode
from engine.fast.pages import PageBatch, build_page_batch, write_token
from engine.model.numerics import device_scope
from engine.model.shards import ShardSpec
from engine.parallel.dcp_attention import PartialAttention, dcp_combine
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.dcp_merge import compact_merge
from engine.parallel.fast_tp import TPFastDecoder
from engine.parallel.sharded import all_heads


class DCPFastDecoder(TPFastDecoder):
    def __init__(self, model: Any, layout: Any, ctx: Any, dtype: torch.dtype = torch.bfloat16,
                 compile: bool = False) -> None:
        if layout.dcp_size != ctx.world_size:
            raise ValueError(f"the pool is planned for dcp_size={layout.dcp_size}, the group has {ctx.world_size} "
                             "ranks")
        super().__init__(model, layout, ctx, dtype, compile)
        self.dcp = DCPLayout(layout.dcp_size, layout.dcp_interleave)
        self.mla_heads = ShardSpec(ctx.world_size, ctx.rank).split(model.cfg.num_heads, "MLA heads")
        """This rank's MLA heads [lo, hi): the rows of its W_UV and gate."""
        self.merge_bytes = 0
        self.merge_fallback_rows = 0

    def _mla(self, m: dict[str, Any], x: torch.Tensor, buffer: torch.Tensor, pages: PageBatch,
             index: int) -> torch.Tensor:
        cfg = self.cfg
        gate, q_abs, latent, key, key_scale, qi, weights = self._seg["_mla_front"](x, *m["front"], **m["front_const"])
        write_token(buffer, self.layout, pages, index, latent, key, key_scale)
        scores = index_scores(buffer, self.layout, pages, index, qi, weights)  # [B, local keys], -inf past
        with device_scope(buffer.device):
            merged = compact_merge(self.ctx, scores, cfg.index_topk, self.dcp)
        self.merge_bytes += merged.bytes_sent
        self.merge_fallback_rows += merged.num_fallback_rows
        selected = merged.local_ids.to(device=buffer.device, dtype=torch.int32).contiguous()
        q_every = all_heads(self.ctx, q_abs)  # [B, H, kv_lora + rope]: every head's query, from its rank
        partial, lse = sparse_mla_decode(buffer, self.layout, pages, index, q_every, selected, m["softmax_scale"],
                                         m["latent_scale"], cfg.kv_lora_rank, merge=False)
        out, lse_nat = merge_splits_lse(partial, lse, m["latent_scale"])
        o_lat = dcp_combine(self.ctx, PartialAttention(out=out, lse=lse_nat)).out  # [B, H, kv_lora]
        lo = self.mla_heads[0]
        mine = o_lat[:, lo:lo + m["w_uv"].shape[0]].contiguous()
        return self._output_rows(x, self._seg["_mla_values"](gate, mine, m["w_uv"]), m["wo"])


def dcp_page_batch(decoder: FastDecoder, dcp: DCPLayout, rank: int, positions: list[int],
                   caches: list[Any]) -> PageBatch:
    """The step's page batch on DCP rank `rank` for requests decoding global positions `positions`: each
    request's last owned local token after this step (-1: none yet) and where this rank stores the new token
    (-1: another rank owns it)."""
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches) or not hasattr(caches[0], "table"):
        raise ValueError("the fast DCP decode runs one row pool of DCPRowCaches per batch")
    attend, write = [], []
    for pos in positions:
        local = dcp.num_local(rank, pos + 1)  # owned tokens among 0..pos
        attend.append(local - 1)
        write.append(local - 1 if dcp.owner(pos) == rank else -1)
    return build_page_batch(decoder.layout, [c.table.attn_row_ids for c in caches],
                            [c.table.kda_row_ids for c in caches], attend, decoder.model.device, write)


def decode_on_dcp_pool(decoder: DCPFastDecoder, token_ids: torch.Tensor, positions: list[int],
                       caches: list[Any]) -> torch.Tensor:
    """One fast DCP decode step on this rank over the requests of `caches` (DCPRowCaches of one pool on the
    decoder's device) -> logits [B, V], the same on every rank."""
    device = decoder.model.device
    if caches[0].pool.buffer.device != device:
        raise ValueError(f"the fast decode needs the pool on the model's device ({device}), it is on "
                         f"{caches[0].pool.buffer.device}")
    pages = dcp_page_batch(decoder, decoder.dcp, decoder.ctx.rank, positions, caches)
    return decoder.decode(caches[0].pool.buffer, token_ids.to(device), pages)
