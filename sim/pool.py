"""The row pool without its bytes: the real `engine.cache.RowPool` bookkeeping (free heap, quarantine, reserve,
eviction through the prefix cache) over a pool that stores nothing.

`TimelessRowPool` subclasses RowPool and only replaces what touches memory: `__init__` allocates no buffer and
`copy_rows` / writes to `buffer` do nothing. Every allocation decision (lowest ids first, `make_room` evicting
cache blocks least recently used first, quarantine until a time) is RowPool's own code. tests/sim checks that it
sets every attribute RowPool's own constructor sets, so a new field there shows up here.
"""

from __future__ import annotations

import heapq

from engine.cache import RowPool
from engine.layout import RowLayout
from engine.model.config import ModelConfig


class _NoBuffer:
    """Stands in for the pool's byte tensor: the scheduler zeroes KDA rows through it (`buffer[rows] = 0`)."""

    def __setitem__(self, key, value) -> None:  # noqa: ANN001 - any index, any value: nothing is stored
        return None


class TimelessRowPool(RowPool):
    def __init__(self, layout: RowLayout, cfg: ModelConfig, num_rows: int) -> None:  # noqa: D107 - see class
        if num_rows < 1:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.layout = layout
        self.cfg = cfg
        self.num_rows = num_rows
        self.conv_dtype = None
        self.buffer = _NoBuffer()
        self._flat = None
        self._free = list(range(num_rows))
        heapq.heapify(self._free)
        self._used: set[int] = set()
        self._reserved: list[int] = []
        self._quarantine = []
        self.spare = None

    def copy_rows(self, dst, src) -> None:  # noqa: ANN001 - row ids; no bytes to copy
        return None
