"""Admission of imports on the decode node: an import that finds too few free rows waits, it does not fail.

An import takes rows for its prompt (plus the engine's small look-ahead, engine/scheduler.py) at once, outside
the engine's queue; its answer takes rows as it grows, as every request's does. When every rank reports
`short_of_rows` (nothing was allocated or posted anywhere), `ImportQueue.admit` keeps the request in a FIFO
queue and tries again, the head first, each time a request leaves the node (rows came back) and at least every
`poll_s` (quarantines and released exports free rows too). The wait is bounded: at most `depth` imports queue
(the next one is shed at once) and each waits at most `wait_s`, never past its lease's expiry (minus a margin);
then `NodeBusy` becomes 503 with Retry-After (node/app.py), which the router treats as "busy", not as a failed
P->D link. While the queue is not empty, new imports join it instead of overtaking it.
Gauge: `pdcluster_node_import_queue_depth`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.api import ImportOutcome
from node.app import NodeBusy
from node.runtime import NodeRuntime

Attempt = Callable[[], Awaitable[tuple[Any, AsyncIterator[Any]]]]
"""Send the ImportKV once: (its first event, the event stream)."""

LEASE_MARGIN_S = 1.0
"""An import still queued this close to its lease's expiry gives up (the rows would be gone when it reads)."""


def is_short_of_rows(outcome: Any) -> bool:
    return isinstance(outcome, ImportOutcome) and outcome.short_of_rows


class ImportQueue:
    """Imports waiting for rows (see the module docstring)."""

    def __init__(self, depth: int, wait_s: float, poll_s: float = 0.25) -> None:
        self.depth = depth
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._waiting: collections.deque[object] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _deadline(self, lease_expiry: float | None) -> float:
        """The monotonic time this import stops waiting."""
        deadline = time.monotonic() + self.wait_s
        if lease_expiry is not None:
            deadline = min(deadline, time.monotonic() + (lease_expiry - time.time()) - LEASE_MARGIN_S)
        return deadline

    async def admit(self, runtime: NodeRuntime, attempt: Attempt, lease_expiry: float | None,
                    stop: Callable[[], None] = lambda: None) -> tuple[Any, AsyncIterator[Any]]:
        """The first event and stream of an import that got its rows (or failed for another reason). `stop` runs
        at every turn of the wait and may raise to end it (a drain hands the queued imports back)."""
        if not self._waiting:
            first, events = await attempt()
            if not is_short_of_rows(first):
                return first, events
            await events.aclose()
        if len(self._waiting) >= self.depth:
            raise NodeBusy(f"no free rows for this import and {len(self._waiting)} imports already wait; retry later")
        deadline = self._deadline(lease_expiry)
        ticket = object()
        self._waiting.append(ticket)
        runtime.metrics.import_queue_depth.set(len(self._waiting))
        try:
            seen, last_try = runtime.num_finished, time.monotonic()
            while True:
                stop()
                now = time.monotonic()
                if now >= deadline:
                    raise NodeBusy("no free rows for this import within its wait; retry later")
                is_head = self._waiting[0] is ticket
                if is_head and (runtime.num_finished != seen or now - last_try >= self.poll_s):
                    seen, last_try = runtime.num_finished, now
                    first, events = await attempt()
                    if not is_short_of_rows(first):
                        return first, events
                    await events.aclose()
                    continue
                await asyncio.sleep(0.05)
        finally:
            self._waiting.remove(ticket)
            runtime.metrics.import_queue_depth.set(len(self._waiting))
