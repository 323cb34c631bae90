"""CUDA graphs of the fast decode step for a fixed (batch size, page-table width).

`GraphedDecode(decoder, buffer, batch, num_pages, kda_groups)` captures `FastDecoder.decode` over static input
tensors (token ids, page table, positions, KDA rows); `__call__(token_ids, pages)` copies a step's inputs into
them and replays the graph. A running batch's page table changes only when a request's rows do (a new block
every `tokens_per_row` tokens), so a steady decode loop loads the table once (`set_pages`, again when rows
change) and then moves only the token ids and positions per step (`step`). The page table is padded to
`num_pages` pages and the indexer scores keys up to `num_pages * b0` (past each request's position they are
-inf, so the selection is the same), which is what lets one graph serve every context up to that width.

Warm-up and capture run under `decoder.gemv_kernels()` (few-row linears as `gemv` kernels, which pay
their launch cost once in a graph). Capture runs the step once eagerly first (Triton compilation, cuBLAS
workspaces) on the rows of the first
batch it is given: that step writes those requests' new cache entries and advances their KDA states. Callers
capture on scratch rows.

`DecodeGraphs` is what the engine runs (engine/fast/model.py): graphs made on demand per (batch bucket, page
bucket): batch sizes padded up to the next of `BATCH_BUCKETS`, page tables to the next power of two of at least
`MIN_PAGE_BUCKET` pages. Padding slots decode token 0 at position 0 of a scratch request (rows the caller sets
aside in the same pool, one attention row and its KDA rows): their writes land there and their logits are
dropped; every real request reads and writes only its own rows, as in an eager step. Captures run on the
scratch rows only. Batches above the largest bucket are not graphed (the caller steps them eagerly). The graphs
share one memory pool (they replay one at a time on one stream); each step returns a copy of its logits.
"""

from __future__ import annotations

import torch
import triton

from engine.fast.decoder import FastDecoder, gemv_kernels
from engine.fast.pages import PageBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_PAGE_BUCKET = 16


class GraphedDecode:
    def __init__(self, decoder: FastDecoder, buffer: torch.Tensor, batch: int, num_pages: int,
                 kda_groups: int, first: PageBatch, first_tokens: torch.Tensor,
                 pool: tuple[int, int] | None = None) -> None:
        device = buffer.device
        b0 = decoder.layout.subblock_tokens
        # The graph reads the decoder's weight copies and writes `buffer` at the addresses captured below: both
        # must live as long as the graph (a decoder dropped after capture would leave the replays reading freed
        # memory that later allocations overwrite).
        self.decoder, self.buffer = decoder, buffer
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.pages = PageBatch(
            subblock_ids=torch.zeros(batch, num_pages, dtype=torch.int32, device=device),
            positions=torch.zeros(batch, dtype=torch.int32, device=device),
            kda_row_ids=torch.zeros(batch, kda_groups, dtype=torch.int64, device=device),
            attn_row_ids=torch.zeros(batch, 0, dtype=torch.int64, device=device),
            max_len=num_pages * b0,
        )
        self._load(first_tokens, first)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), gemv_kernels():  # the kernels the capture records, compiled here
            decoder.decode(buffer, self.tokens, self.pages)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), gemv_kernels():
            self.logits = decoder.decode(buffer, self.tokens, self.pages)

    def _load(self, token_ids: torch.Tensor, pages: PageBatch) -> None:
        self.set_pages(pages)
        self.tokens.copy_(token_ids)

    def set_pages(self, pages: PageBatch) -> None:
        """Load the batch's page table and KDA rows (positions too); `pages` may cover more tokens than are
        cached yet (rows allocated ahead): keys past each request's position are never read."""
        width = pages.subblock_ids.shape[1]
        if width > self.pages.subblock_ids.shape[1] or pages.subblock_ids.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"a step of {pages.subblock_ids.shape[0]} requests x {width} pages does not fit the "
                             f"graph's {tuple(self.pages.subblock_ids.shape)}")
        self.pages.subblock_ids[:, :width].copy_(pages.subblock_ids)
        self.pages.positions.copy_(pages.positions)
        self.pages.kda_row_ids.copy_(pages.kda_row_ids)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay with new token ids [B] and positions [B] (host or device tensors) over the loaded table."""
        self.tokens.copy_(token_ids, non_blocking=True)
        self.pages.positions.copy_(positions, non_blocking=True)
        self.graph.replay()
        return self.logits

    def __call__(self, token_ids: torch.Tensor, pages: PageBatch) -> torch.Tensor:
        self._load(token_ids, pages)
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(self, decoder: FastDecoder, buffer: torch.Tensor, scratch_attn_row: int,
                 scratch_kda_rows: list[int], batch_buckets: tuple[int, ...] = BATCH_BUCKETS) -> None:
        """`scratch_attn_row` / `scratch_kda_rows`: rows of `buffer` set aside for the padding slots (and the
        captures); they must not belong to any request."""
        layout = decoder.layout
        if len(scratch_kda_rows) != layout.kda_groups:
            raise ValueError(f"the scratch request needs {layout.kda_groups} KDA rows, got {len(scratch_kda_rows)}")
        self.decoder, self.buffer, self.batch_buckets = decoder, buffer, tuple(sorted(batch_buckets))
        self.scratch_subblock = scratch_attn_row * layout.subblocks_per_row
        self.scratch_kda = torch.tensor(scratch_kda_rows, dtype=torch.int64, device=buffer.device)
        self.graphs: dict[tuple[int, int], GraphedDecode] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def bucket(self, batch: int, num_pages: int) -> tuple[int, int] | None:
        """The (batch, pages) graph a step of this shape replays; None above the largest batch bucket."""
        size = next((b for b in self.batch_buckets if b >= batch), None)
        if size is None:
            return None
        return size, max(MIN_PAGE_BUCKET, triton.next_power_of_2(num_pages))

    def pad(self, token_ids: torch.Tensor, pages: PageBatch, size: int,
            num_pages: int) -> tuple[torch.Tensor, PageBatch]:
        """The step's inputs padded to `size` requests x `num_pages` pages: padding slots decode token 0 at
        position 0 of the scratch request; page-table columns past a request's pages point at the scratch page
        (never read: keys past a request's position are not scored)."""
        batch, width = pages.subblock_ids.shape
        device = self.buffer.device
        sb = torch.full((size, num_pages), self.scratch_subblock, dtype=torch.int32, device=device)
        sb[:batch, :width] = pages.subblock_ids
        positions = torch.zeros(size, dtype=torch.int32, device=device)
        positions[:batch] = pages.positions
        kda = self.scratch_kda.expand(size, -1).clone()
        kda[:batch] = pages.kda_row_ids
        tokens = torch.zeros(size, dtype=torch.int64, device=device)
        tokens[:batch] = token_ids
        padded = PageBatch(subblock_ids=sb, positions=positions, kda_row_ids=kda, attn_row_ids=pages.attn_row_ids[:0],
                           max_len=num_pages * self.decoder.layout.subblock_tokens)
        return tokens, padded

    def decode(self, token_ids: torch.Tensor, pages: PageBatch) -> torch.Tensor | None:
        """Logits [B, V] of one step from its graph (made on first use), or None when B is above every bucket."""
        batch = token_ids.shape[0]
        key = self.bucket(batch, pages.subblock_ids.shape[1])
        if key is None:
            return None
        runner = self.graphs.get(key)
        if runner is None:
            runner = self.graphs[key] = self._capture(*key)
        tokens, padded = self.pad(token_ids, pages, *key)
        return runner(tokens, padded)[:batch].clone()

    def _capture(self, size: int, num_pages: int) -> GraphedDecode:
        device = self.buffer.device
        empty = PageBatch(subblock_ids=torch.zeros(0, 0, dtype=torch.int32, device=device),
                          positions=torch.zeros(0, dtype=torch.int32, device=device),
                          kda_row_ids=torch.zeros(0, self.scratch_kda.shape[0], dtype=torch.int64, device=device),
                          attn_row_ids=torch.zeros(0, 0, dtype=torch.int64, device=device), max_len=1)
        tokens, first = self.pad(torch.zeros(0, dtype=torch.int64, device=device), empty, size, num_pages)
        return GraphedDecode(self.decoder, self.buffer, size, num_pages, self.decoder.layout.kda_groups, first,
                             tokens, pool=self.mempool)
