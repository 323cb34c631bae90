"""FastModel: what an engine runs with `kernels="fast"`: the fast prefill and the fast decode.

It has KimiModel's prefill/decode interface (engine/runner.py calls it like the model). Decode takes the
request caches the runner built (`engine.cache.RowSequenceCache`: one pool, single rank), builds the step's page
batch from their block tables and runs `FastDecoder` on the pool's buffer, which must live on the model's device.
Prefill runs `FastPrefiller` when the cache is a single-rank RowSequenceCache whose pool lives on the model's
device (otherwise, and for everything else, the wrapped reference model's).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.fast.decoder import FastDecoder
from engine.fast.pages import build_page_batch
from engine.fast.prefill import FastPrefiller
from engine.model.model import KimiModel


class FastModel:
    def __init__(self, model: KimiModel, layout: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = model
        self.layout = layout
        self.decoder = FastDecoder(model, layout, dtype)
        self.prefiller = FastPrefiller(model, layout, dtype, decoder=self.decoder)

    def prefill(self, token_ids: torch.Tensor, cache: Any, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        pool = getattr(cache, "pool", None)
        if (not hasattr(cache, "table") or pool is None or pool.layout.dcp_size != 1
                or pool.buffer.device != self.model.device):
            return self.model.prefill(token_ids, cache, start, all_logits)
        return self.prefiller.prefill(pool.buffer, token_ids, cache.table.attn_row_ids, cache.table.kda_row_ids,
                                      start, all_logits)

    def decode(self, token_ids: torch.Tensor, positions: list[int], caches: list[Any]) -> torch.Tensor:
        return decode_on_pool(self.decoder, self.layout, token_ids, positions, caches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def decode_on_pool(decoder: FastDecoder, layout: Any, token_ids: torch.Tensor, positions: list[int],
                   caches: list[Any]) -> torch.Tensor:
    """One fast decode step of `decoder` over the requests of `caches` (RowSequenceCaches of one row pool on the
    decoder's device): the step's page batch from their block tables, then the step -> logits [B, V]."""
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches) or not hasattr(caches[0], "table"):
        raise ValueError("the fast decode runs one row pool of RowSequenceCaches per batch")
    device = decoder.model.device
    if pool.buffer.device != device:
        raise ValueError(f"the fast decode needs the pool on the model's device ({device}), it is on "
                         f"{pool.buffer.device}")
    pages = build_page_batch(layout, [c.table.attn_row_ids for c in caches], [c.table.kda_row_ids for c in caches],
                             positions, device)
    return decoder.decode(pool.buffer, token_ids.to(device), pages)
