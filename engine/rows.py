"""The row pool's bookkeeping, without its bytes: which rows are free, allocated, quarantined or reserved.

`RowBook` is what the scheduler asks of a pool (engine/scheduler.py): `allocate(n)` / `free(ids)` / `num_free`,
lowest ids first, so ranks that see the same commands make the same allocations (SPMD lockstep); when free rows
run out, allocation first evicts unreferenced prefix-cache blocks (`spare`, engine/prefix_cache.py) and
`num_available` counts those as available; quarantine, `reclaim(now)`, `hold(key)` and `reserve_request` as
engine/cache.py describes them. It stores nothing: the subclass provides `buffer`, the rows' bytes indexed by row
id (engine/cache.py `RowPool`: a torch tensor; the simulator's pool, sim/pool.py: a stand-in that stores nothing),
through which KDA rows are zeroed and copied. No torch here, so the scheduler and the simulator import none.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from engine.layout import RowLayout
from engine.model.config import ModelConfig


class OutOfRows(RuntimeError):
    """The pool has fewer free rows than asked for."""


@dataclass
class BlockTable:
    attn_row_ids: list[int] = field(default_factory=list)
    kda_row_ids: list[int] = field(default_factory=list)

    @property
    def row_ids(self) -> list[int]:
        return self.attn_row_ids + self.kda_row_ids


@dataclass
class _Quarantined:
    key: str
    until: float
    row_ids: tuple[int, ...]


class RowBook:
    """Rows of one pool by state (see the module docstring); `buffer` is the subclass's."""

    buffer: Any
    """The rows' bytes, indexed by row id (`buffer[rows] = 0`, `buffer[dst] = buffer[src]`)."""

    def __init__(self, layout: RowLayout, cfg: ModelConfig, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.layout = layout
        self.cfg = cfg
        self.num_rows = num_rows
        self._free = list(range(num_rows))
        heapq.heapify(self._free)
        self._used: set[int] = set()
        self._reserved: list[int] = []
        self._quarantine: list[_Quarantined] = []
        self.spare = None
        """The prefix cache (engine/prefix_cache.PrefixCache) whose unreferenced blocks make room on demand."""

    # ---- allocation ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Rows requests can have: all but those `reserve_request` set aside."""
        return self.num_rows - len(self._reserved)

    @property
    def num_quarantined(self) -> int:
        return sum(len(q.row_ids) for q in self._quarantine)

    @property
    def num_available(self) -> int:
        """Free rows plus the rows the prefix cache would give up now (`spare`, engine/prefix_cache.py)."""
        return len(self._free) + (self.spare.evictable_rows() if self.spare is not None else 0)

    def make_room(self, count: int) -> None:
        """Evict unreferenced cache blocks (least recently used first) until `count` rows are free, if possible."""
        if count > len(self._free) and self.spare is not None:
            self.spare.evict(count - len(self._free))

    def copy_rows(self, dst: list[int], src: list[int] | tuple[int, ...]) -> None:
        """Whole rows src[i] -> dst[i] (a KDA snapshot taken or resumed)."""
        self.buffer[list(dst)] = self.buffer[list(src)]

    def allocate(self, count: int) -> list[int]:
        self.make_room(count)
        if count > len(self._free):
            raise OutOfRows(f"need {count} rows, {len(self._free)} free of {self.num_rows}")
        ids = [heapq.heappop(self._free) for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, row_ids: list[int] | tuple[int, ...]) -> None:
        for row in row_ids:
            if row not in self._used:
                raise ValueError(f"row {row} is not allocated")
            self._used.remove(row)
            heapq.heappush(self._free, row)

    def quarantine(self, row_ids: list[int] | tuple[int, ...], until: float, key: str) -> None:
        """Take allocated rows out of use until `until` (then `reclaim` frees them); `key` names them for `hold`."""
        for row in row_ids:
            if row not in self._used:
                raise ValueError(f"row {row} is not allocated")
            self._used.remove(row)
        self._quarantine.append(_Quarantined(key, until, tuple(row_ids)))

    def reclaim(self, now: float) -> list[int]:
        """Free every quarantined row whose time is up; the rows freed."""
        due = [q for q in self._quarantine if q.until <= now]
        if not due:
            return []
        self._quarantine = [q for q in self._quarantine if q.until > now]
        freed = [row for q in due for row in q.row_ids]
        for row in freed:
            heapq.heappush(self._free, row)
        return freed

    def hold(self, key: str) -> bool:
        """Keep the rows quarantined under `key` out of the pool for good; False if there are none."""
        found = False
        for q in self._quarantine:
            if q.key == key:
                q.until, found = math.inf, True
        return found

    def rows_for(self, num_tokens: int) -> tuple[int, int]:
        """(attention rows, KDA rows) a request of num_tokens needs on this rank."""
        return self.layout.rows_per_request(num_tokens)

    def allocate_request(self, num_tokens: int, zero_kda: bool = True) -> BlockTable:
        """Rows for a request of up to num_tokens tokens; KDA rows zeroed (a fresh state) unless told not to."""
        num_attn, num_kda = self.rows_for(num_tokens)
        self.make_room(num_attn + num_kda)
        if num_attn + num_kda > len(self._free):
            raise OutOfRows(f"a request of {num_tokens} tokens needs {num_attn + num_kda} rows, {self.num_free} free")
        table = BlockTable(self.allocate(num_attn), self.allocate(num_kda))
        if zero_kda:
            self.buffer[table.kda_row_ids] = 0
        return table

    def reserve_request(self, num_tokens: int) -> BlockTable:
        """Rows of a request of num_tokens set aside for the engine's own use for the pool's life (the padding
        slots of the fast decode's CUDA graphs, engine/fast/graphs.py): they leave the capacity (`num_usable`)
        instead of counting as used, and cannot be freed."""
        table = self.allocate_request(num_tokens)
        rows = [*table.attn_row_ids, *table.kda_row_ids]
        self._used.difference_update(rows)
        self._reserved.extend(rows)
        return table

    def extend(self, table: BlockTable, num_tokens: int) -> None:
        """Grow a block table so it covers num_tokens tokens."""
        need = self.rows_for(num_tokens)[0] - len(table.attn_row_ids)
        if need > 0:
            table.attn_row_ids.extend(self.allocate(need))
