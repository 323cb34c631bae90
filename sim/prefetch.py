"""A closed-loop workload's sessions drawn ahead by worker processes, on the host's other cores.

A closed-loop workload's session k is unit k of its stream, a pure function of k (loadgen/schedule.py `Workload`:
agentx and random seed each unit's generator with its index), and drawing an agentx session's texts is about a
tenth of a simulated hour's CPU time. `PrefetchedSessions` forks
`workers` processes; worker w draws sessions w, w + workers, w + 2 * workers, ... with the workload's own
`session(index)` and hands them over pickled, at most `depth` ahead. The driver asks for sessions in index order
(sim/driver.py `_closed_loop`), so `session(k)` returns worker k % workers' next session; a request out of that
order stops the workers and is served, as every later one, by the workload in this process. The sessions are the same objects by value (tests/sim/test_prefetch.py), so a run gives
the same records with or without workers. `close()` stops the workers (the ones still drawing ahead are
terminated: nothing they hold is needed).
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

from loadgen.schedule import Session, Workload


def _draw(workload: Workload, first: int, stride: int, out: Queue) -> None:
    """Worker: sessions first, first + stride, ... into `out`, until the workload has none left (None sent)."""
    index = first
    while True:
        session = workload.session(index)
        out.put(session)
        if session is None:
            return
        index += stride


class PrefetchedSessions:
    """`workload`'s `session(index)`, drawn ahead by `workers` forked processes (see the module docstring)."""

    def __init__(self, workload: Workload, workers: int, depth: int = 16) -> None:
        if workers < 1:
            raise ValueError(f"session workers must be at least 1, got {workers}")
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.workload = workload
        self.workers = workers
        self._next = 0
        """The index the workers' next sessions start at (the driver's next request, when it asks in order)."""
        self._ended: set[int] = set()
        """Workers that sent their None (the workload ran out)."""
        ctx = multiprocessing.get_context("fork")
        self._queues: list[Queue] = [ctx.Queue(depth) for _ in range(workers)]
        self._procs: list[BaseProcess] = [
            ctx.Process(target=_draw, args=(workload, w, workers, q), daemon=True, name=f"sim-sessions-{w}")
            for w, q in enumerate(self._queues)]
        for proc in self._procs:
            proc.start()

    def __getattr__(self, name: str):  # noqa: ANN204 - the workload's other attributes (is_open_loop, name, ...)
        return getattr(self.workload, name)

    def session(self, index: int) -> Session | None:
        if index != self._next or self._procs is None:
            self._stop()
            return self.workload.session(index)
        worker = index % self.workers
        self._next += 1
        if worker in self._ended:
            return None
        session = self._queues[worker].get()
        if session is None:
            self._ended.add(worker)
        return session

    def _stop(self) -> None:
        """No more prefetching: an out-of-order request, or the end of the level."""
        procs, self._procs = self._procs, None
        if procs is None:
            return
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()
        for queue in self._queues:
            queue.close()
            queue.cancel_join_thread()

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> PrefetchedSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
