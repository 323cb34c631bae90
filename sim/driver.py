"""loadgen's drivers on the simulated clock: the same workload units, the same closed and open loops.

Closed loop (agentx, random; loadgen/runner.py): `concurrency` slots each take the next session
(`workload.session(k)`) and run its steps in order, pausing each step's think time (cut at the deadline) and
running a fork's branches concurrently; no request starts after the deadline or past `max_requests`; a failed
request ends its session (or branch). Open loop (trace): each unit is sent at its `arrival_s`, at most
`concurrency` in flight (the wait is `queued_s`). After the deadline, requests still running get `drain_s`;
those not done then are recorded `cancelled` (the simulated nodes finish them anyway: their work is not
aborted, docs/PLANNING.md). The level's duration runs from its start to the last request's end.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.records import RequestRecord
from loadgen.schedule import Fork, RequestSpec, Session, Step, Workload
from sim.cluster import SimCluster
from sim.prefetch import PrefetchedSessions


@dataclass
class LevelRun:
    concurrency: int
    duration_s: float
    records: list[RequestRecord]
    num_sessions: int
    started_s: float


@dataclass
class _Level:
    cluster: SimCluster
    workload: Workload
    concurrency: int
    t0: float
    deadline: float
    max_requests: int | None
    records: list[RequestRecord] = field(default_factory=list)
    num_started: int = 0
    num_sessions: int = 0
    pending: dict[int, tuple[RequestSpec, float]] = field(default_factory=dict)
    is_closed: bool = False

    @property
    def now(self) -> float:
        return self.cluster.loop.now - self.t0

    def may_start(self) -> bool:
        under_cap = self.max_requests is None or self.num_started < self.max_requests
        return under_cap and self.now < self.deadline

    def send(self, spec: RequestSpec, then: Callable[[bool], None], queued_s: float = 0.0) -> None:
        self.num_started += 1
        token = self.num_started
        self.pending[token] = (spec, self.now)

        def done(record: RequestRecord) -> None:
            if self.is_closed or token not in self.pending:
                return
            del self.pending[token]
            self.records.append(record)
            then(record.outcome != "error")

        self.cluster.send(spec, self.concurrency, done, origin=self.t0, queued_s=queued_s)


def _run_steps(lv: _Level, steps: tuple[Step, ...], index: int, then: Callable[[bool], None]) -> None:
    """Run steps[index:] in order, then call `then(ok)`."""
    if index >= len(steps) or not lv.may_start():
        return then(index >= len(steps))
    step = steps[index]
    if isinstance(step, Fork):
        left = [len(step.branches)]

        def branch_done(_: bool) -> None:
            left[0] -= 1
            if left[0] == 0:
                _run_steps(lv, steps, index + 1, then)

        if not step.branches:
            return _run_steps(lv, steps, index + 1, then)
        for branch in step.branches:
            _run_steps(lv, branch, 0, branch_done)
        return None

    def sent(ok: bool) -> None:
        if ok:
            _run_steps(lv, steps, index + 1, then)
        else:
            then(False)

    def go() -> None:
        if not lv.may_start():
            return then(False)
        lv.send(step, sent)

    if step.think_s > 0:
        lv.cluster.loop.after(min(step.think_s, max(0.0, lv.deadline - lv.now)), go)
    else:
        go()
    return None


def _closed_loop(lv: _Level) -> None:
    counter = itertools.count()

    def slot(_: bool = True) -> None:
        if not lv.may_start():
            return
        session: Session | None = lv.workload.session(next(counter))
        if session is None:
            return
        lv.num_sessions += 1
        _run_steps(lv, session.steps, 0, slot)

    for _ in range(lv.concurrency):
        slot()


def _open_loop(lv: _Level) -> None:
    waiting: deque[tuple[RequestSpec, float]] = deque()
    in_flight = [0]

    def release(_: bool) -> None:
        in_flight[0] -= 1
        if waiting:
            spec, due = waiting.popleft()
            start(spec, due)

    def start(spec: RequestSpec, due: float) -> None:
        in_flight[0] += 1
        lv.send(spec, release, queued_s=max(0.0, lv.now - due))

    def arrive(spec: RequestSpec, due: float) -> None:
        if in_flight[0] < lv.concurrency:
            start(spec, due)
        else:
            waiting.append((spec, due))

    for index in itertools.count():
        session = lv.workload.session(index)
        if session is None:
            break
        spec = session.steps[0]
        assert isinstance(spec, RequestSpec)
        due = spec.arrival_s or 0.0
        if due >= lv.deadline or (lv.max_requests is not None and index >= lv.max_requests):
            break
        lv.num_sessions += 1
        lv.num_started += 1
        lv.cluster.loop.at(lv.t0 + due, lambda s=spec, d=due: arrive(s, d))
    lv.num_started = 0  # counted again as they are sent


def run_level(cluster: SimCluster, workload: Workload, concurrency: int, duration_s: float, drain_s: float,
              max_requests: int | None = None, session_workers: int = 0) -> LevelRun:
    """One level on the cluster's clock, from its current time. `session_workers` > 0: a closed loop's sessions are
    drawn ahead by that many worker processes (sim/prefetch.py; the same sessions, so the same records)."""
    loop = cluster.loop
    if workload.is_open_loop or session_workers <= 0:
        lv = _Level(cluster, workload, concurrency, loop.now, duration_s, max_requests)
        (_open_loop if workload.is_open_loop else _closed_loop)(lv)
        loop.run(until=lv.t0 + duration_s + drain_s)
    else:
        with PrefetchedSessions(workload, session_workers) as prefetched:
            lv = _Level(cluster, prefetched, concurrency, loop.now, duration_s, max_requests)
            _closed_loop(lv)
            loop.run(until=lv.t0 + duration_s + drain_s)
    lv.is_closed = True
    end = loop.now - lv.t0
    for spec, started in lv.pending.values():
        lv.records.append(RequestRecord(request_id=spec.request_id, session_id=spec.session_id,
                                        concurrency=concurrency, outcome="cancelled", start_s=started, end_s=end,
                                        num_input_tokens=spec.num_input_tokens, max_tokens=spec.max_tokens))
    ends = [r.end_s for r in lv.records]
    return LevelRun(concurrency, max(ends) if ends else end, lv.records, lv.num_sessions, lv.t0)
