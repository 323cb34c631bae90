"""Hosts a node's engine on W rank processes and offers an asyncio interface to the HTTP layer.

Design (SPMD lockstep):
- Every rank process builds the same engine replica for its rank (model shard, row pool, scheduler) through
  a `WorkerSpec` factory, one torch thread each, pinned to a core.
- The driver is a thread in the server process. Each round it takes the commands the HTTP layer queued
  (submit, abort, export, import, release), sends the same `StepPlan` to every rank and waits for every
  rank's `StepReply`. All ranks apply the same commands in the same order and then run one engine step, so
  their deterministic schedulers make identical decisions (same batch, same row ids) and their collectives
  line up. Token events are taken from rank 0; import outcomes, transport notifications and exposed rows from all
  ranks (notifications and exposures go to the `on_notice` handlers before the round's events are delivered).
- Time: each plan carries the driver's clock (`StepPlan.now`); ranks measure quarantines in it, never in their
  own clocks, so they free the same rows in the same round.
- Imports: a rank answers one `ImportOutcome` per `ImportKV`, possibly rounds later than another rank (its
  READs are polled between decode steps). The driver keeps each request's parts until every rank's part is in,
  then delivers one merged outcome (an error if any part failed); only then may the node send StartDecode.
  A part that says a READ could not be cancelled makes the driver queue `HoldRows` for that request at once,
  before the merged outcome reaches the node (so before any Abort the node sends in reply to it). While
  imports are pending and nothing else runs, rounds come every `import_poll_s` (the ranks poll their READs).
- Failure: a rank that exits, closes its pipe or misses the reply deadline marks the executor dead; every
  in-flight request receives a failure event (no hang), `healthy` turns False, new work is refused.
The module never imports torch: rank processes do, inside the worker factory.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import itertools
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.api import (
    Abort,
    Command,
    EngineFailure,
    Event,
    HoldRows,
    ImportKV,
    ImportOutcome,
    RankStats,
    RowsExposed,
    TransportNotice,
)
from engine.ports import free_port
from node.protocol import StepPlan, StepReply


@dataclass(frozen=True)
class WorkerSpec:
    """How a rank builds its worker: `factory` is "module:function", called as
    `factory(config, ctx)` (ctx: engine.parallel.groups.ParallelContext) inside the rank process, returning an object with
    `startup_info() -> Any`, `begin_round(now)`, `apply(cmd) -> list[Event]`, `step() -> list[Event]`,
    `stats() -> RankStats` and `close()`."""

    factory: str
    config: Any
    world_size: int = 1
    pin_cores: bool = True
    step_timeout_s: float = 120.0
    idle_poll_s: float = 0.02
    import_poll_s: float = 0.001
    """Round interval while imports are pending and no request runs (how often ranks poll their READs)."""
    device: str = "cpu"
    """What the ranks compute on: "cpu" (a gloo group) or "cuda" (rank r binds local GPU r, an NCCL group)."""
    process_group: bool = True
    """Whether the ranks join a torch process group. False for a worker that runs no collective (a backend whose
    module says `PROCESS_GROUP = False`, such as the tests' toy backend): its ranks never import torch and get a
    `RankIdentity` for a context."""


@dataclass(frozen=True)
class RankIdentity:
    """The context of a rank outside any process group: who it is, nothing to communicate through."""

    rank: int
    world_size: int
    group: None = None
    device: str = "cpu"
    backend: str = "none"


class ExecutorDead(RuntimeError):
    """The executor lost a rank; no more work is accepted."""


@dataclass(frozen=True)
class _Retired:
    """Queued right after an `Abort`: set once the round that applied that Abort has delivered its events. Until
    then a new request under the same id waits (`Executor.events`): the old request's final `abort` event, routed
    by request id, would otherwise end the new one (an import that failed and is recomputed under its id)."""

    request_id: str
    done: threading.Event


def _rank_main(spec: WorkerSpec, rank: int, init_method: str, conn: Any) -> None:
    """Entry of one rank process: join the group, build the worker, serve StepPlans until told to stop."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        if spec.pin_cores and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
        if spec.process_group:
            import torch

            from engine.parallel.groups import default_backend, init_context

            torch.set_num_threads(1)
            ctx = init_context(rank, spec.world_size, init_method, default_backend(spec.device))
        else:
            ctx = RankIdentity(rank, spec.world_size, device=spec.device)
        module_name, func_name = spec.factory.split(":")
        worker = getattr(importlib.import_module(module_name), func_name)(spec.config, ctx)
        conn.send(("ready", worker.startup_info()))
    except BaseException as exc:  # report, then exit: the driver turns this into a start failure
        conn.send(("error", f"rank {rank} failed to start: {type(exc).__name__}: {exc}"))
        return
    while True:
        plan = conn.recv()
        if plan is None:
            break
        worker.begin_round(plan.now)
        events: list[Event] = []
        for cmd in plan.commands:
            try:
                events.extend(worker.apply(cmd))
            except ValueError as exc:  # bad input the engine found: this request fails, the ranks go on
                events.append(EngineFailure(request_id=cmd.request_id, error=str(exc), status=400))
        if plan.run_step:
            events.extend(worker.step())
        conn.send(StepReply(rank=rank, events=events, stats=worker.stats()))
    worker.close()


@dataclass
class _Inflight:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class ExecutorState:
    """What the driver knows after the last round (read by /metrics and /health)."""

    healthy: bool = False
    error: str | None = None
    stats: list[RankStats] = field(default_factory=list)
    rounds: int = 0
    timings: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_PENDING_TIMINGS))
    cache: Any = None
    """Rank 0's latest prefix-cache report (engine.results.CacheReport; None until the first)."""
    """Rank 0's durations not yet taken by the metrics (`take_timings`); the oldest drop past the bound."""

    def take_timings(self) -> list[tuple[str, str, float]]:
        """Pop what the driver thread queued (deque appends and pops are thread-safe; this is the one consumer)."""
        return [self.timings.popleft() for _ in range(len(self.timings))]


MAX_PENDING_TIMINGS = 10_000


class Executor:
    """The node's handle on its ranks. Start with `start()`, stop with `stop()`."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.state = ExecutorState()
        self.startup_info: list[Any] = []
        self._commands: queue.Queue[Command | _Retired] = queue.Queue()
        self._inflight: dict[str, _Inflight] = {}
        self._retiring: dict[str, _Retired] = {}
        """Request ids with an Abort queued whose round has not delivered its events yet."""
        self._marks: list[_Retired] = []
        """The marks the round being run took from the queue (the driver thread's)."""
        self._notice_handlers: list[Any] = []
        self._lock = threading.Lock()
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._import_parts: dict[str, list[ImportOutcome]] = {}
        """Requests with an ImportKV sent to the ranks -> the parts (one per rank) received so far."""

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 300.0) -> None:
        """Spawn the ranks, wait for every rank to be ready, start the driver thread."""
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.spec.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(self.spec, rank, init_method, child), daemon=True,
                               name=f"pdcluster-rank{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns):
            reply = self._recv(rank, conn, deadline)
            if reply is None or reply[0] != "ready":
                message = reply[1] if reply else self.state.error or f"rank {rank} did not start"
                self._terminate()
                raise ExecutorDead(message)
            self.startup_info.append(reply[1])
        self.state.healthy = True
        self._thread = threading.Thread(target=self._drive, name="pdcluster-driver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
        self._terminate()
        self.state.healthy = False

    def _terminate(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs if proc.pid is not None]

    @property
    def healthy(self) -> bool:
        return self.state.healthy and all(proc.is_alive() for proc in self._procs)

    # ------------------------------------------------------------------ async interface

    def on_notice(self, handler: Any) -> None:
        """Call `handler(event)` (from the driver thread) for every `TransportNotice` and `RowsExposed` of any rank,
        before the round's other events are delivered."""
        self._notice_handlers.append(handler)

    def submit(self, cmd: Command) -> None:
        """Queue a command that has no event stream of its own (abort, release, ...)."""
        if not self.healthy:
            raise ExecutorDead(self.state.error or "executor is not running")
        self._commands.put(cmd)

    async def events(self, cmd: Command, on_leave: Abort | None = None) -> AsyncIterator[Event]:
        """Queue `cmd` (it must carry a request_id) and yield its events until a final one.

        If the consumer stops early (client disconnect), the request is aborted on every rank: by `on_leave`
        (for `cmd`'s request; default a plain `Abort`)."""
        request_id = cmd.request_id
        if on_leave is not None and on_leave.request_id != request_id:
            raise ValueError(f"on_leave aborts {on_leave.request_id!r}, not the command's {request_id!r}")
        with self._lock:
            retiring = self._retiring.get(request_id)
        if retiring is not None:
            await self._settled(retiring)
        loop = asyncio.get_running_loop()
        inflight = _Inflight(asyncio.Queue(), loop)
        with self._lock:
            if request_id in self._inflight:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._inflight[request_id] = inflight
        finished = False
        try:
            self.submit(cmd)
            while True:
                event = await inflight.queue.get()
                finished = event.is_final  # before yielding: the consumer may stop right after a final event
                yield event
                if finished:
                    return
        finally:
            with self._lock:
                self._inflight.pop(request_id, None)
            if not finished and self.healthy:
                self._queue_abort(on_leave or Abort(request_id=request_id))

    def abort(self, request_id: str, reads_done: bool = False) -> bool:
        """Abort a request on every rank (`reads_done`: no READ can target its rows, engine/api.py `Abort`); True
        if it was in flight here. A new request under the same id waits until this abort's events are delivered."""
        with self._lock:
            known = request_id in self._inflight
        if self.healthy:
            self._queue_abort(Abort(request_id=request_id, reads_done=reads_done))
        return known

    def _queue_abort(self, cmd: Abort) -> None:
        mark = _Retired(cmd.request_id, threading.Event())
        with self._lock:  # the mark right behind its Abort: the round that takes the mark applied the Abort
            self._commands.put(cmd)
            self._commands.put(mark)
            self._retiring[cmd.request_id] = mark

    async def _settled(self, mark: _Retired) -> None:
        """Until the round that applied `mark`'s Abort delivered its events (or the executor died, or a step's
        deadline passed: the driver then fails every request anyway)."""
        deadline = time.monotonic() + self.spec.step_timeout_s
        while not mark.done.is_set() and self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    def _settle(self, marks: list[_Retired]) -> None:
        for mark in marks:
            mark.done.set()
            with self._lock:
                if self._retiring.get(mark.request_id) is mark:
                    del self._retiring[mark.request_id]

    # ------------------------------------------------------------------ driver thread

    def _recv(self, rank: int, conn: Any, deadline: float) -> Any:
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    self.state.error = f"rank {rank} closed its pipe"
                    return None
            if not self._procs[rank].is_alive():
                self.state.error = f"rank {rank} exited with code {self._procs[rank].exitcode}"
                return None
        self.state.error = f"rank {rank} missed its deadline"
        return None

    def _next_plan(self) -> StepPlan | None:
        busy = any(s.has_work for s in self.state.stats)
        wait_s = 0 if busy else self.spec.import_poll_s if self._import_parts else self.spec.idle_poll_s
        try:
            first = self._commands.get(timeout=wait_s)
            commands = [first]
        except queue.Empty:
            commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        self._marks = [cmd for cmd in commands if isinstance(cmd, _Retired)]
        commands = [cmd for cmd in commands if not isinstance(cmd, _Retired)]
        for cmd in commands:
            if isinstance(cmd, ImportKV):
                self._import_parts[cmd.request_id] = []
        return StepPlan(round_id=next(self._ids), commands=tuple(commands), run_step=True, now=time.monotonic())

    def _drive(self) -> None:
        while not self._stopping.is_set():
            plan = self._next_plan()
            replies = self._round(plan)
            if replies is None:
                self._fail_all(self.state.error or "a rank failed")
                return
            self._dispatch(replies)
            self._settle(self._marks)

    def _round(self, plan: StepPlan) -> list[StepReply] | None:
        try:
            for conn in self._conns:
                conn.send(plan)
        except (OSError, BrokenPipeError):
            self.state.error = "a rank pipe is closed"
            return None
        deadline = time.monotonic() + self.spec.step_timeout_s
        replies = []
        for rank, conn in enumerate(self._conns):
            reply = self._recv(rank, conn, deadline)
            if reply is None:
                return None
            replies.append(reply)
        return replies

    def _dispatch(self, replies: list[StepReply]) -> None:
        self.state.stats = [reply.stats for reply in replies]
        self.state.rounds += 1
        if replies:
            self.state.timings.extend(replies[0].stats.timings)
            if replies[0].stats.cache is not None:
                self.state.cache = replies[0].stats.cache
        for reply in replies:  # first: a rank's exposure of an export is known before the export is delivered
            for event in reply.events:
                if isinstance(event, (TransportNotice, RowsExposed)):
                    for handler in self._notice_handlers:
                        handler(event)
        for reply in replies:
            for event in reply.events:
                if isinstance(event, ImportOutcome):
                    self._import_part(event)
                elif not isinstance(event, (TransportNotice, RowsExposed)) and reply.rank == 0:
                    self._deliver(event)

    def _import_part(self, part: ImportOutcome) -> None:
        """Keep one rank's import outcome; deliver the merge once every rank's part is in."""
        if part.uncancelled:  # before the merged outcome: any Abort the node sends in reply comes after it
            self._commands.put(HoldRows(request_id=part.request_id))
        parts = self._import_parts.setdefault(part.request_id, [])
        parts.append(part)
        if len(parts) < self.spec.world_size:
            return
        del self._import_parts[part.request_id]
        errors = [p.error for p in parts if p.error]
        self._deliver(ImportOutcome(request_id=part.request_id, error="; ".join(errors) or None,
                                    num_bytes=sum(p.num_bytes for p in parts), seconds=max(p.seconds for p in parts),
                                    num_descriptors=sum(p.num_descriptors for p in parts),
                                    post_s=tuple(t for p in parts for t in p.post_s),
                                    uncancelled=any(p.uncancelled for p in parts),
                                    short_of_rows=all(p.short_of_rows for p in parts)))

    def _deliver(self, event: Event) -> None:
        with self._lock:
            inflight = self._inflight.get(event.request_id)
        if inflight is not None:
            inflight.loop.call_soon_threadsafe(inflight.queue.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        self.state.healthy = False
        self.state.error = message
        self.end_all(message)
        with self._lock:
            marks = list(self._retiring.values())
        self._settle(marks)

    def end_all(self, message: str, status: int = 500, keep: frozenset[str] = frozenset()) -> int:
        """End every request in flight but those in `keep` with an `EngineFailure` (each one's consumer then aborts
        it, freeing its rows); the ranks go on. Returns how many were ended."""
        with self._lock:
            ids = [request_id for request_id in self._inflight if request_id not in keep]
            pending = [self._inflight[request_id] for request_id in ids]
        for request_id, inflight in zip(ids, pending):
            inflight.loop.call_soon_threadsafe(inflight.queue.put_nowait,
                                               EngineFailure(request_id=request_id, error=message, status=status))
        return len(ids)


