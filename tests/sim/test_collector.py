"""The cyclic collector around a simulated level (sim/run.py `_collector_paused`): off during it, back as it was
after, nothing left frozen, and a cycle made during the level still collected afterwards."""

from __future__ import annotations

import gc
import weakref

from sim.run import _collector_paused


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_collector_paused_then_restored_and_cycles_still_collected() -> None:
    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        assert alive() is not None  # a cycle: reference counts do not free it
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
