"""FastModel: what an engine runs with `kernels="fast"`: the fast prefill and the fast decode.

It has KimiModel's prefill/decode interface (engine/runner.py calls it like the model). Decode takes the
request caches the runner built (`engine.cache.RowSequenceCache`: one pool, single rank), builds the step's page
batch from their block tables and runs `FastDecoder` on the pool's buffer, which must live on the model's device.
Prefill runs `FastPrefiller` when the cache is a single-rank RowSequenceCache whose pool lives on the model's
device (otherwise, and for everything else, the wrapped reference model's).

On CUDA (`graphs` default) the decoder's torch segments run through torch.compile and decode steps replay CUDA
graphs (engine/fast/graphs.py `DecodeGraphs`: one per batch bucket and page-table bucket, captured on first use;
`warm_up`, which a node runs at start, pays the compilation and the captures of the common shapes). Each pool
gives one scratch request (one attention row and its KDA rows, taken from the pool at its first graphed step)
for the padding slots (`RowPool.reserve_request`: the pool's capacity, `num_usable`, shrinks by those rows). A
batch above the largest bucket, or a step when the pool has no rows left for the
scratch request, decodes eagerly. On one H200 the pro-rank b1 / 32K step takes ~17 ms eagerly and ~1.3 ms
graphed (benchmarks/RESULTS.md, 2026-12-04).
"""

from __future__ import annotations

import time

from typing import Any

import torch

from engine.cache import OutOfRows
from engine.fast.backend import interpreter_active
from engine.fast.decoder import FastDecoder
from engine.fast.pages import PageBatch, build_page_batch
from engine.fast.prefill import FastPrefiller
from engine.model.model import KimiModel


class FastModel:
    def __init__(self, model: KimiModel, layout: Any, dtype: torch.dtype = torch.bfloat16,
                 graphs: bool | None = None) -> None:
        """`graphs`: compiled segments and CUDA-graphed decode steps (default: on a CUDA device outside the Triton
        interpreter; True elsewhere is an error)."""
        cuda = model.device.type == "cuda" and not interpreter_active()
        if graphs and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA device (the model is on {model.device.type}"
                             f"{', under the Triton interpreter' if interpreter_active() else ''})")
        self.graphs = cuda if graphs is None else graphs
        self.model = model
        self.layout = layout
        self.decoder = FastDecoder(model, layout, dtype, compile=self.graphs)
        self.prefiller = FastPrefiller(model, layout, dtype, decoder=self.decoder)
        self._graphs: dict[tuple[int, int], Any] = {}  # (pool id, buffer address) -> DecodeGraphs

    def prefill(self, token_ids: torch.Tensor, cache: Any, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        pool = getattr(cache, "pool", None)
        if (not hasattr(cache, "table") or pool is None or pool.layout.dcp_size != 1
                or pool.buffer.device != self.model.device):
            return self.model.prefill(token_ids, cache, start, all_logits)
        return self.prefiller.prefill(pool.buffer, token_ids, cache.table.attn_row_ids, cache.table.kda_row_ids,
                                      start, all_logits)

    def decode(self, token_ids: torch.Tensor, positions: list[int], caches: list[Any]) -> torch.Tensor:
        if not self.graphs:
            return decode_on_pool(self.decoder, self.layout, token_ids, positions, caches)
        pages = page_batch_on_pool(self.decoder, self.layout, positions, caches)
        pool = caches[0].pool
        tokens = token_ids.to(self.model.device)
        graphs = self._graphs_for(pool)
        logits = None if graphs is None else graphs.decode(tokens, pages)
        return self.decoder.decode(pool.buffer, tokens, pages) if logits is None else logits

    def warm_up(self, pool: Any, max_batch: int, prompt_tokens: int = 16, long_tokens: int | None = None) -> list[int]:
        """Pay the one-time costs before serving: the segments' compilation (graphs on) and the decode graphs of
        every batch bucket up to `max_batch` at the smallest page-table bucket (`max_batch` 0: the prefill
        only, for a node that does not decode). The prefills compile what a first request would otherwise compile:
        a short prompt (`prompt_tokens` zeros), a prompt that continues it (start > 0: a prefix-cache hit or the
        next chunk of a chunked prefill), and a prompt of `long_tokens` (default: the indexer's top-k plus
        `prompt_tokens`, so the sparse selection runs; on one H100 a first 4,811-token prompt after a 16-token
        warm-up took 25.6 s to its first token). Each decode bucket runs the request in every slot. Rows are
        allocated here and freed at the end (what these steps write is discarded with them); a long prompt the
        pool cannot hold next to its serving requests is left out, and its phase is missing from
        `warm_up_seconds`. Returns the batch sizes decoded."""
        from engine.cache import RowSequenceCache
        from engine.fast.graphs import BATCH_BUCKETS

        sizes = [b for b in BATCH_BUCKETS if b <= max_batch]
        long_tokens = self.model.cfg.index_topk + prompt_tokens if long_tokens is None else long_tokens
        zeros = torch.zeros(2 * prompt_tokens, dtype=torch.int64)
        table = pool.allocate_request(2 * prompt_tokens + 1)
        self.warm_up_seconds = {}
        try:
            cache = RowSequenceCache(pool, table)
            with torch.no_grad():
                self._timed("prefill", self.prefill, zeros[:prompt_tokens], cache)
                self._timed("prefill_continued", self.prefill, zeros[prompt_tokens:], cache, prompt_tokens)
                for size in sizes:
                    self._timed(f"decode_b{size}", self.decode, torch.zeros(size, dtype=torch.int64),
                                [prompt_tokens] * size, [cache] * size)
        finally:
            pool.free(table.row_ids)
        if long_tokens > 2 * prompt_tokens:
            try:
                table = pool.allocate_request(long_tokens + 1)
            except OutOfRows:
                return sizes
            try:
                with torch.no_grad():
                    self._timed("prefill_long", self.prefill, torch.zeros(long_tokens, dtype=torch.int64),
                                RowSequenceCache(pool, table))
            finally:
                pool.free(table.row_ids)
        return sizes

    def _timed(self, phase: str, fn: Any, *args: Any) -> None:
        """Run one warm-up step and keep its wall time (synchronised) in `warm_up_seconds[phase]`: the first
        prefill pays the segments' compilation, each decode bucket its compilation and graph capture."""
        start = time.perf_counter()
        fn(*args)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.warm_up_seconds[phase] = round(time.perf_counter() - start, 2)

    def _graphs_for(self, pool: Any) -> Any:
        """The pool's DecodeGraphs (made with its scratch request on first use); None while the pool has no rows
        for the scratch request."""
        from engine.fast.graphs import DecodeGraphs

        key = (id(pool), pool.buffer.data_ptr())
        graphs = self._graphs.get(key)
        if graphs is None:
            try:
                scratch = pool.reserve_request(1)  # out of the capacity for good, never counted as used
            except OutOfRows:
                return None
            graphs = self._graphs[key] = DecodeGraphs(self.decoder, pool.buffer, scratch.attn_row_ids[0],
                                                      list(scratch.kda_row_ids))
            graphs.scratch_table = scratch
        return graphs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def decode_on_pool(decoder: FastDecoder, layout: Any, token_ids: torch.Tensor, positions: list[int],
                   caches: list[Any]) -> torch.Tensor:
    """One fast decode step of `decoder` over the requests of `caches` (RowSequenceCaches of one row pool on the
    decoder's device): the step's page batch from their block tables, then the step -> logits [B, V]."""
    pages = page_batch_on_pool(decoder, layout, positions, caches)
    return decoder.decode(caches[0].pool.buffer, token_ids.to(decoder.model.device), pages)


def page_batch_on_pool(decoder: FastDecoder, layout: Any, positions: list[int], caches: list[Any]) -> PageBatch:
    """The step's page batch from the block tables of `caches` (RowSequenceCaches of one row pool on the
    decoder's device)."""
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches) or not hasattr(caches[0], "table"):
        raise ValueError("the fast decode runs one row pool of RowSequenceCaches per batch")
    device = decoder.model.device
    if pool.buffer.device != device:
        raise ValueError(f"the fast decode needs the pool on the model's device ({device}), it is on "
                         f"{pool.buffer.device}")
    return build_page_batch(layout, [c.table.attn_row_ids for c in caches], [c.table.kda_row_ids for c in caches],
                            positions, device)
