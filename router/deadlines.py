"""Leg deadlines without a timer per leg: `async with deadlines.within(seconds):` like `asyncio.timeout`.

A guard is an entry in one heap per router; one ticker task wakes every `tick_s`, cancels the tasks whose
deadline passed and turns that cancellation into `TimeoutError` at the guard's exit, as `asyncio.timeout`
does. Entering and leaving a guard costs a heap push and a flag; an `asyncio.timeout` costs an event-loop
timer armed and disarmed per leg, which showed as about 8% of the router's time under load. Deadlines
are at most `tick_s` late (leg timeouts are seconds; the default tick is 50 ms). A guard left early stays
in the heap until it is popped or the heap is compacted (when most of its entries are such guards), so
memory stays proportional to the legs in flight.

Deadlines are on `time.monotonic()` and the event loop is looked up once, not per guard: on Python 3.11
every `asyncio.get_running_loop()` (also inside `asyncio.current_task()`) makes a getpid system call.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time


class Guard:
    __slots__ = ("deadlines", "when", "task", "is_done", "is_fired")

    def __init__(self, deadlines: Deadlines, when: float) -> None:
        self.deadlines, self.when = deadlines, when
        self.task: asyncio.Task | None = None
        self.is_done = False
        self.is_fired = False

    async def __aenter__(self) -> Guard:
        self.task = asyncio.current_task(self.deadlines.loop())
        self.deadlines.add(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self.is_done = True
        if not self.is_fired:
            self.deadlines.num_done += 1
        if self.is_fired and exc_type is asyncio.CancelledError:
            if self.task.uncancel() == 0:
                raise TimeoutError from exc
        return False


class Deadlines:
    """The deadlines of one router (one event loop)."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._heap: list[tuple[float, int, Guard]] = []
        self._seq = itertools.count()
        self._ticker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_done = 0
        """Heap entries whose guard exited before its deadline."""

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The router's event loop (looked up again only once the one known is closed)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.get_running_loop()
        return self._loop

    def within(self, seconds: float) -> Guard:
        return Guard(self, time.monotonic() + seconds)

    def add(self, guard: Guard) -> None:
        heapq.heappush(self._heap, (guard.when, next(self._seq), guard))
        if self._ticker is None or self._ticker.done():
            self._ticker = self.loop().create_task(self._tick())

    def expire(self, now: float) -> None:
        """Cancel every task whose guard is still open past its deadline."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, guard = heapq.heappop(heap)
            if guard.is_done:
                self.num_done -= 1
            else:
                guard.is_fired = True
                guard.task.cancel()

    async def _tick(self) -> None:
        while self._heap:
            await asyncio.sleep(self.tick_s)
            self.expire(time.monotonic())
            if self.num_done > 1024 and 2 * self.num_done > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].is_done]
                heapq.heapify(self._heap)
                self.num_done = 0
