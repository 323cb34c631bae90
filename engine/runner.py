"""Drives the model and the row pool for one engine step on one rank: a prefill or a decode batch -> logits.

The runner owns no policy: the scheduler decides who runs; the runner turns each request's block table into a
cache view (`RowSequenceCache`, or what `make_cache` builds: a DCP rank's `DCPRowCache`) and calls the model.
Decode logits of a request are bit-identical whatever batch it runs in (engine/model/model.py explains why), so
there is no separate deterministic mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.cache import BlockTable, RowPool, RowSequenceCache
from engine.model.model import KimiModel
from engine.scheduler import Request


class ModelRunner:
    def __init__(self, model: KimiModel, pool: RowPool,
                 make_cache: Callable[[RowPool, BlockTable], Any] | None = None) -> None:
        self.model = model
        self.pool = pool
        self.make_cache = make_cache or RowSequenceCache

    def _cache(self, req: Request) -> Any:
        assert req.table is not None, f"request {req.request_id} has no rows"
        return self.make_cache(self.pool, req.table)

    @torch.no_grad()
    def prefill(self, req: Request, start: int = 0, end: int | None = None, all_logits: bool = False) -> torch.Tensor:
        """Run prompt positions [start, end) of `req` (default: all) into its rows; positions before `start` are
        already there -> logits [V] of the last one, or with `all_logits` [end - start, V] of each."""
        end = len(req.prompt_token_ids) if end is None else end
        tokens = torch.tensor(req.prompt_token_ids[start:end], dtype=torch.int64)
        logits = self.model.prefill(tokens, self._cache(req), start, all_logits)
        return logits if all_logits else logits[0]

    @torch.no_grad()
    def decode(self, reqs: list[Request] | tuple[Request, ...]) -> torch.Tensor:
        """Feed each request's last output token at its position -> logits [B, V]."""
        tokens = torch.tensor([r.output_token_ids[-1] for r in reqs], dtype=torch.int64)
        positions = [r.num_tokens - 1 for r in reqs]
        return self.model.decode(tokens, positions, [self._cache(r) for r in reqs])
