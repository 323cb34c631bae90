"""SPMD wrappers of the single-device model: the same prefill/decode interface as `KimiModel`, run over a rank
group. `TimedModel` (one rank: the plain model, prefill steps timed), `TPModel` (prefill token- or head-sharded,
decode with heads split) and `DCPModel` (decode with the cache split by token). The engine takes any of them as
its `model`; the model itself never imports parallel code.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("pdcluster.engine")


class TimedModel:
    """The plain single-rank model with its prefill steps timed (mode `single`); the base of the SPMD wrappers,
    which time theirs by sharding mode. `timings` holds the steps since the last `take_timings()`."""

    parallelism = "single"
    """The wrapper's parallelism in the kernel registry (engine/kernels.py), which decides the kernel set and names
    what runs each phase; `fast_kernels` builds what it names."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.timings: list[tuple[str, str, float]] = []

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        started = time.perf_counter()
        logits = self.model.prefill(token_ids, cache, start, all_logits)
        self.timings.append(("prefill", "single", time.perf_counter() - started))
        return logits

    def take_timings(self) -> tuple[tuple[str, str, float], ...]:
        """The steps timed since the last call (name, label, seconds)."""
        timings, self.timings = tuple(self.timings), []
        return timings

    def counters(self) -> tuple[tuple[str, float], ...]:
        """Cumulative counters (name, total) of the wrapper's collectives since it was built (none on one rank)."""
        return ()

    def fast_kernels(self, layout: Any) -> "TimedModel":
        """Switch to the fast kernel set (engine/fast/): the wrapped model becomes a FastModel over `layout`."""
        from engine.fast.model import FastModel

        self.model = FastModel(self.model, layout)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class TPModel(TimedModel):
    """The rank's shard of the model (engine/model/shards.py: its heads, experts and output rows), whose prefill
    and decode run SPMD over the rank group (engine/parallel): prefill token-sharded (steps of at least
    `token_threshold` tokens) or head-sharded, decode with the KDA and attention heads split (TP), MoE expert
    parallel. Logits are identical on every rank, so every rank's scheduler samples the same tokens. The pool's
    KDA rows hold this rank's heads (layout tp_size = W).
    With `fast_kernels(layout)` (an engine with kernels="fast") decode runs `fast_tp.TPFastDecoder` and prefill
    `fast_prefill.TPFastPrefiller` (same modes, fast kernels) instead, on the same shard (their bf16 copies of
    it)."""

    parallelism = "tp"

    def __init__(self, model: Any, ctx: Any, token_threshold: int) -> None:
        from engine.parallel.sharded import check_shard
        from engine.parallel.tp import apply_tp

        check_shard(ctx, model)
        super().__init__(model)
        self.ctx, self.token_threshold = ctx, token_threshold
        self.cfg = model.cfg
        self.sharded = apply_tp(model, ctx)
        """The rank's shard with its MoE layers expert-parallel (the model itself, changed in place): what the
        reference SPMD prefill and decode run, and what the fast steps copy."""
        self.alltoall_bytes = 0
        self.fast_decoder: Any = None
        """The fast TP decode step (`fast_kernels`), or None: the reference TP decode."""
        self.fast_prefiller: Any = None
        """The fast SPMD prefill (`fast_kernels`), or None: the reference SPMD prefill."""

    def counters(self) -> tuple[tuple[str, float], ...]:
        return (("alltoall_bytes", float(self.alltoall_bytes)),)

    def _on_fast_pool(self, cache: Any) -> bool:
        """The cache is a request's rows in a single-rank-layout pool on the model's device (what the fast prefill
        writes into); anything else (a DCP node's whole-sequence scratch cache) runs the reference prefill."""
        pool = getattr(cache, "pool", None)
        return (hasattr(cache, "table") and pool is not None and pool.layout.dcp_size == 1
                and pool.buffer.device == self.model.device)

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        from engine.parallel.prefill import PrefillBatch, choose_mode, parallel_prefill

        batch = PrefillBatch((token_ids,), (start,))
        # a resumed prefill (a chunk, a prefix-cache hit) is token-sharded whatever its size: the head-sharded
        # mode is equal within fp32 only, and a prompt's tail chunk must give the bits of the one-shot prefill
        mode = "token" if start else choose_mode(batch, self.token_threshold)
        started = time.perf_counter()
        if self.fast_prefiller is not None and self._on_fast_pool(cache):
            result = self.fast_prefiller.prefill(cache.pool.buffer, token_ids, cache.table.attn_row_ids,
                                                 cache.table.kda_row_ids, start, mode, all_logits)
        else:
            result = parallel_prefill(self.ctx, self.sharded, batch, [cache], mode, all_logits=all_logits)
        self.timings.append(("prefill", f"{mode}_sharded", time.perf_counter() - started))
        self.alltoall_bytes += result.stats.exchange_bytes
        return result.logits

    def decode(self, token_ids: Any, positions: list[int], caches: list[Any]) -> Any:
        if self.fast_decoder is not None:
            from engine.fast.model import decode_on_pool

            return decode_on_pool(self.fast_decoder, self.fast_decoder.layout, token_ids, positions, caches)
        from engine.parallel.dcp_decode import parallel_decode

        return parallel_decode(self.ctx, self.sharded, token_ids, positions, caches, mode="tp").logits

    def fast_kernels(self, layout: Any) -> "TimedModel":
        """The fast decode over the TP group (engine/parallel/fast_tp.py: KDA heads and experts split over the
        ranks) and the fast SPMD prefill (engine/parallel/fast_prefill.py: token- or head-sharded as the
        reference chooses), on the rank's shard."""
        from engine.parallel.fast_prefill import TPFastPrefiller
        from engine.parallel.fast_tp import TPFastDecoder

        self.fast_decoder = TPFastDecoder(self.model, layout, self.ctx)
        self.fast_prefiller = TPFastPrefiller(self.fast_decoder)
        return self


class DCPModel(TPModel):
    """The rank's shard of the model (as `TPModel`) whose decode splits the cache by token over the rank group
    (DCP = W): each rank
    keeps its owned tokens (`engine.cache.DCPRowCache`, whose ownership rule comes from the pool layout's
    `dcp_interleave` and is the one the decode step uses),
    scores them, takes part in the exact compact top-k merge and then in the exact attention over the gathered
    selected latents (`attention="exact"`, logits bitwise as on one rank) or the LSE merge of partial outputs
    (`attention="lse"`) (engine/parallel/dcp_decode.py).
    KDA heads are split as under TP. A local prefill (colocated requests, the `recompute` load-failure policy)
    runs the SPMD prefill into a temporary whole-sequence cache of the request, then keeps this rank's share;
    a prefill that resumes at `start` > 0 (a chunk, a prefix-cache hit) first all-gathers every rank's owned
    rows of positions 0..start-1 into that cache and copies in the rank's KDA state.
    With `fast_kernels(layout)` decode runs `fast_dcp.DCPFastDecoder` (partial attention merged by log-sum-exp)."""

    parallelism = "dcp"

    def __init__(self, model: Any, ctx: Any, token_threshold: int, merge: str = "compact",
                 attention: str = "exact") -> None:
        super().__init__(model, ctx, token_threshold)
        self.merge, self.attention = merge, attention
        self.merge_bytes = 0
        self.merge_fallbacks = 0

    def counters(self) -> tuple[tuple[str, float], ...]:
        return (*super().counters(), (f"dcp_merge_bytes_{self.merge}", float(self.merge_bytes)),
                ("dcp_merge_fallbacks", float(self.merge_fallbacks)))

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        from engine.parallel.kda_shard import rank_cache

        end = start + int(token_ids.shape[0])
        whole = rank_cache(self.cfg, end, self.ctx.world_size, self.ctx.rank)
        if start:
            self._gather_prefix(cache, whole, start)
        logits = super().prefill(token_ids, whole, start, all_logits)
        for i in range(self.cfg.num_mla_layers):
            rows = whole.read_attention(i, end)
            cache.write_attention(i, start, rows.latent[start:], rows.index_key[start:], rows.index_scale[start:])
        for i in range(self.cfg.num_kda_layers):
            cache.write_kda(i, whole.read_kda(i))
        return logits

    def _gather_prefix(self, cache: Any, whole: Any, start: int) -> None:
        """Positions 0..start-1 of every rank's owned rows (all-gathered, data only) and this rank's KDA state
        into the whole-sequence cache `whole`."""
        from engine.parallel.comm import all_gather_varlen

        layout = cache.layout
        places = [layout.global_ids(r, layout.num_local(r, start)) for r in range(self.ctx.world_size)]
        for i in range(self.cfg.num_mla_layers):
            own = cache.read_owned(i, start)
            for name, mine in (("latent", own.latent), ("index_key", own.index_key), ("index_scale", own.index_scale)):
                target = getattr(whole, name)
                for r, part in enumerate(all_gather_varlen(self.ctx, mine.contiguous())):
                    target[i, places[r].to(target.device)] = part.to(target.device)
        for i in range(self.cfg.num_kda_layers):
            whole.write_kda(i, cache.read_kda(i))

    def decode(self, token_ids: Any, positions: list[int], caches: list[Any]) -> Any:
        if self.fast_decoder is not None:
            from engine.parallel.fast_dcp import decode_on_dcp_pool

            logits = decode_on_dcp_pool(self.fast_decoder, token_ids, positions, caches)
            self.merge_bytes, self.fast_decoder.merge_bytes = self.merge_bytes + self.fast_decoder.merge_bytes, 0
            self.merge_fallbacks += self.fast_decoder.merge_fallback_rows
            self.fast_decoder.merge_fallback_rows = 0
            return logits
        from engine.parallel.dcp_decode import parallel_decode

        result = parallel_decode(self.ctx, self.sharded, token_ids, positions, caches, mode="dcp",
                                 layout=caches[0].layout, merge=self.merge, attention=self.attention)
        self.merge_bytes += result.stats.merge_bytes
        self.merge_fallbacks += result.stats.merge_fallback_rows
        return result.logits

    def fast_kernels(self, layout: Any) -> "TimedModel":
        """The fast decode over the DCP group (engine/parallel/fast_dcp.py: the cache split by token, the
        partial attentions merged by log-sum-exp; KDA heads and experts split as in the fast TP decode); prefill
        stays the reference one (no fast prefiller: the registry's fast DCP prefill cell), logged here with the
        attention mode."""
        from engine.kernels import cell, device_kind
        from engine.parallel.fast_dcp import DCPFastDecoder

        self.fast_decoder = DCPFastDecoder(self.model, layout, self.ctx)
        if self.ctx.rank == 0:
            device = device_kind(self.model.device)
            prefill, decode = (cell("fast", "dcp", phase, device) for phase in ("prefill", "decode"))
            log.warning("kernels=fast on %d DCP ranks: decode %s (%s)%s; prefill %s (%s kernels: %s)",
                        self.ctx.world_size, decode.runs, decode.note,
                        " (attention='exact', bitwise single-rank logits, is the reference kernels' mode)"
                        if self.attention == "exact" else "", prefill.runs, prefill.runs_set, prefill.note)
        return self

    def make_cache(self, pool: Any, table: Any) -> Any:
        from engine.cache import DCPRowCache

        return DCPRowCache(pool, table, self.ctx.rank)
