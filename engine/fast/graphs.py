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
capture on scratch rows (the benchmark does; the engine does not use graphs yet).
"""

from __future__ import annotations

import torch

from engine.fast.decoder import FastDecoder, gemv_kernels
from engine.fast.pages import PageBatch


class GraphedDecode:
    def __init__(self, decoder: FastDecoder, buffer: torch.Tensor, batch: int, num_pages: int,
                 kda_groups: int, first: PageBatch, first_tokens: torch.Tensor) -> None:
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
        with torch.cuda.graph(self.graph), gemv_kernels():
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
