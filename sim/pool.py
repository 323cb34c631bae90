"""The row pool without its bytes: the real row bookkeeping (engine/rows.py `RowBook`: free heap, quarantine,
reserve, eviction through the prefix cache), which `engine.cache.RowPool` extends with a torch buffer, over a pool
that stores nothing.

`TimelessRowPool` is a `RowBook` whose `buffer` stores nothing: `copy_rows` / writes to `buffer` do nothing. Every
allocation decision (lowest ids first, `make_room` evicting cache blocks least recently used first, quarantine
until a time) is RowBook's own code, as RowPool's is; no torch is imported (engine/cache.py is not). tests/sim
checks that it sets every attribute RowPool's own constructor sets, so a new field there shows up here.
"""

from __future__ import annotations

from engine.layout import RowLayout
from engine.model.config import ModelConfig
from engine.rows import RowBook


class _NoBuffer:
    """Stands in for the pool's byte tensor: the scheduler zeroes KDA rows through it (`buffer[rows] = 0`)."""

    def __setitem__(self, key, value) -> None:  # noqa: ANN001 - any index, any value: nothing is stored
        return None


class TimelessRowPool(RowBook):
    def __init__(self, layout: RowLayout, cfg: ModelConfig, num_rows: int) -> None:  # noqa: D107 - see class
        super().__init__(layout, cfg, num_rows)
        self.conv_dtype = None
        self.buffer = _NoBuffer()
        self._flat = None

    def copy_rows(self, dst, src) -> None:  # noqa: ANN001 - row ids; no bytes to copy
        return None
