"""Drive a workload at one concurrency level for a duration; a sweep runs one level after another.

Closed loop (agentx, random): `concurrency` slots each take the next session and run its steps in order,
sleeping each step's think time and running forks' branches concurrently; no request starts after the
deadline; a failed request ends its session (or sub-agent branch), and a connection failure makes its slot
wait CONNECT_BACKOFF_S before the next session. Open loop (trace): each request is sent at its arrival time, at most `concurrency` in flight
(waiting time is recorded as `queued_s`). After the deadline in-flight requests get `drain_s` to finish,
then are cancelled (recorded as cancelled). The level's duration runs from its start to the last finish.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import httpx

from loadgen.client import Target, send
from loadgen.progress import Progress
from loadgen.records import CONNECT, RequestRecord
from loadgen.schedule import Fork, RequestSpec, Session, Step, Workload

CONNECT_BACKOFF_S = 0.2


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    duration_s: float
    records: list[RequestRecord]
    num_sessions: int
    started_unix: float


@dataclass
class _Level:
    """Shared state of one running level."""

    client: httpx.AsyncClient
    target: Target
    concurrency: int
    t0: float
    deadline: float
    max_requests: int | None
    records: list[RequestRecord]
    num_started: int = 0
    num_sessions: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def may_start(self) -> bool:
        under_cap = self.max_requests is None or self.num_started < self.max_requests
        return under_cap and self.now() < self.deadline


async def _run_request(lv: _Level, spec: RequestSpec) -> bool:
    """Send one request after its think time; False if it failed (its session should stop)."""
    if spec.think_s > 0:
        await asyncio.sleep(min(spec.think_s, max(0.0, lv.deadline - lv.now())))
    if not lv.may_start():
        return False
    lv.num_started += 1
    record = await send(lv.client, lv.target, spec, lv.concurrency, lv.t0, lv.records)
    if record.outcome != "error":
        return True
    if record.error_kind == CONNECT:  # the endpoint is gone: back off instead of spinning
        await asyncio.sleep(min(CONNECT_BACKOFF_S, max(0.0, lv.deadline - lv.now())))
    return False


async def _run_steps(lv: _Level, steps: tuple[Step, ...]) -> bool:
    """Run steps in order; a failed request ends its branch (later turns would build on its reply)."""
    for step in steps:
        if not lv.may_start():
            return False
        if isinstance(step, Fork):
            await asyncio.gather(*(_run_steps(lv, branch) for branch in step.branches))
        elif not await _run_request(lv, step):
            return False
    return True


async def _closed_loop(lv: _Level, workload: Workload) -> None:
    counter = itertools.count()

    async def slot() -> None:
        while lv.may_start():
            session: Session | None = workload.session(next(counter))
            if session is None:
                return
            lv.num_sessions += 1
            await _run_steps(lv, session.steps)

    await asyncio.gather(*(slot() for _ in range(lv.concurrency)))


async def _open_loop(lv: _Level, workload: Workload) -> None:
    gate = asyncio.Semaphore(lv.concurrency)
    tasks: list[asyncio.Task] = []

    async def one(spec: RequestSpec, due: float) -> None:
        async with gate:
            await send(lv.client, lv.target, spec, lv.concurrency, lv.t0, lv.records, max(0.0, lv.now() - due))

    try:
        for index in itertools.count():
            session = workload.session(index)
            if session is None:
                break
            spec = session.steps[0]
            assert isinstance(spec, RequestSpec)
            due = spec.arrival_s or 0.0
            if due >= lv.deadline or (lv.max_requests is not None and lv.num_started >= lv.max_requests):
                break
            if due > lv.now():
                await asyncio.sleep(due - lv.now())
            lv.num_started += 1
            lv.num_sessions += 1
            tasks.append(asyncio.create_task(one(spec, due)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _watch(lv: _Level, progress: Progress, duration_s: float) -> None:
    while True:
        in_flight = lv.num_started - len(lv.records)
        progress.update(lv.concurrency, lv.now(), duration_s, lv.records, in_flight)
        await asyncio.sleep(progress.interval_s)


async def run_level(client: httpx.AsyncClient, target: Target, workload: Workload, concurrency: int,
                    duration_s: float, drain_s: float, max_requests: int | None = None,
                    progress: Progress | None = None, records: list[RequestRecord] | None = None) -> LevelResult:
    """Run one level; the records include cancelled ones if the drain deadline was hit. Records go into
    `records` as they finish, so a caller that is interrupted still holds the partial level."""
    started_unix, t0 = time.time(), time.perf_counter()
    lv = _Level(client, target, concurrency, t0, duration_s, max_requests, [] if records is None else records)
    driver = _open_loop if workload.is_open_loop else _closed_loop
    work = asyncio.create_task(driver(lv, workload))
    watcher = asyncio.create_task(_watch(lv, progress, duration_s)) if progress and progress.enabled else None
    try:
        await asyncio.wait_for(asyncio.shield(work), timeout=duration_s + drain_s)
    except asyncio.TimeoutError:
        pass
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        if watcher:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            progress.update(concurrency, lv.now(), duration_s, lv.records, 0, force=True)
            progress.finish()
    ends = [r.end_s for r in lv.records]
    return LevelResult(concurrency, max(ends) if ends else lv.now(), lv.records, lv.num_sessions, started_unix)
