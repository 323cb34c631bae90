"""The discrete-event clock: a heap of (time, sequence, callback); ties run in the order they were scheduled.

Nothing here knows what an event means. `at(t, fn)` returns a handle whose `cancel()` makes the event a no-op
(an interrupted decode segment is rescheduled that way). Time never goes backwards: scheduling in the past
runs the event now.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Event:
    __slots__ = ("fn", "is_cancelled")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, when: float, fn: Callable[[], None]) -> Event:
        event = Event(fn)
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), event))
        return event

    def after(self, delay: float, fn: Callable[[], None]) -> Event:
        return self.at(self.now + delay, fn)

    def run(self, until: float = float("inf")) -> None:
        """Run events in time order until none is left or the next is later than `until`."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, event = heapq.heappop(heap)
            if event.is_cancelled:
                continue
            self.now = when
            self.num_events += 1
            event.fn()
        if until != float("inf"):
            self.now = max(self.now, until)
