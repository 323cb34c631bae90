"""One simulated node (prefill or decode instance): the real engine scheduler and prefix cache, timed by a profile.

The step loop mirrors `engine.engine.Engine.step` call for call (reclaim, `Scheduler.schedule`, the prefill
chunk's `publish` / `prefill_done` / `keep_prompt_state`, first token: `export` or `start_running`, decodes
publishing at block boundaries, `keep_tail` + `finish` at max_tokens), imports follow `allocate_for_import` /
`start_decode`, exports end with `release`. What the engine computes is replaced by a duration from the
profile's `StepCost` (stretched by the host's core sharing on CPU profiles); nothing else is decided here
(tests/sim/test_engine_parity.py holds it to the engine's decisions).

Commands (new requests, imports, start_decode, releases) reach the scheduler between steps, as the node's rank
rounds deliver them; an import short of rows waits in the node's import queue, head first. A run of decode-only
steps with nothing queued is one *segment* (many steps, one event), counted lazily by `sim.decode_batch`: it ends
at the batch's first block boundary or finished request, and is cut at the next step boundary when a command
arrives. Decodes beyond `max_batch` wait, as in the engine.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api import SamplingParams
from engine.layout import RowLayout
from engine.model.config import ModelConfig
from engine.rows import OutOfRows
from engine.scheduler import Request, RequestState, Scheduler
from router.cache_view import CacheReport
from sim.cache_report import ObservedPrefixCache, SessionReports
from sim.decode_batch import BOUNDARY, DecodeBatch
from sim.events import Event, EventLoop
from sim.pool import TimelessRowPool
from sim.profile import StepCost
from sim.tokens import TokenRuns

MAX_SESSIONS = 1024
"""Sessions a node remembers for its cache report (engine/engine.py keeps as many)."""


class SimRequest(Request):
    """The engine's `Request`, compared by identity. The scheduler looks requests up in its lists (`req in
    running`, `running.remove(req)`), where the dataclass equality compares every field of every member; request
    ids are unique among a scheduler's requests, so two distinct requests are never equal and identity answers
    the same."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class Flight:
    """What the cluster wants to hear about one request on one instance."""

    out_uid: int
    on_tokens: Callable[[list[float], int], None]
    """(emission times, tokens): every emission is one output chunk."""
    on_exported: Callable[[float, int, int], None] | None = None
    """P side: (time, prompt tokens reused from its cache, the export's generation)."""
    on_imported: Callable[[float, int, int], None] | None = None
    """D side: rows admitted (time, rows to read, tokens reused)."""
    on_finished: Callable[[float, Request], None] | None = None


class HostCores:
    """The ranks computing now on a host of `cores` cores (None: no sharing), per core. Each node pins its rank r
    to core r mod cores (node/executor.py `_rank_main`, `pin_cores`), so every instance's rank 0 shares core 0: an
    instance of W ranks runs on cores {r mod cores : r < W}, and its ranks step in lockstep (collectives every
    layer), so what slows its step is its most loaded core: `start` answers the busy ranks there, its own
    included (k), and the step takes `StepCost.stretched(k)` times its time (k with contention 1: the core's time
    split evenly). One rank's step beside a two-rank instance's on two cores has k = 2, where the pooled count
    (3 ranks / 2 cores) said 1.5. When a count changes, every other instance's decode segment is cut at its next
    step boundary, so the steps after it are timed with the new counts (a segment's steps all share the factor of
    its start)."""

    def __init__(self, cores: int | None) -> None:
        self.cores = cores
        self.busy = [0] * (cores or 0)
        """Busy ranks per core."""
        self.instances: list[SimInstance] = []

    def cores_of(self, ranks: int) -> range:
        """The cores an instance of `ranks` ranks is pinned to."""
        assert self.cores is not None
        return range(min(ranks, self.cores))

    def sharing(self, ranks: int) -> float:
        """The busy ranks on the most loaded core of an instance of `ranks` ranks that is counted busy now."""
        if self.cores is None:
            return 1.0
        return float(max(self.busy[c] for c in self.cores_of(ranks)))

    def start(self, ranks: int, who: SimInstance | None = None) -> float:
        if self.cores is None:
            return 1.0
        for r in range(ranks):
            self.busy[r % self.cores] += 1
        self._changed(who)
        return self.sharing(ranks)

    def end(self, ranks: int, who: SimInstance | None = None) -> None:
        if self.cores is None:
            return
        for r in range(ranks):
            self.busy[r % self.cores] -= 1
        self._changed(who)

    def _changed(self, who: SimInstance | None) -> None:
        for inst in self.instances:
            if inst is not who and inst.segment is not None:
                inst._cut_segment()


@dataclass
class _Segment:
    t0: float
    first_s: float
    """Duration of the first step."""
    growth_s: float
    """How much each further step is longer (the batch's contexts grow by one token each)."""
    num_steps: int
    event: Event | None = None


@dataclass
class InstanceSpec:
    name: str
    role: str
    pool: str
    tp: int
    dcp: int
    num_rows: int
    max_batch: int
    max_step_tokens: int | None
    prefix_cache: bool
    max_context: int
    engine: str = "reference"
    fingerprint: str = "sim"
    decode_first_tokens: int | None = None
    """The pool's decode priority (engine/api.py `EngineConfig.decode_first_tokens`); a deferred prompt's wait counts
    one step per decode segment here (a segment runs to the batch's next event, within the bound's tokens)."""


class SimInstance:
    def __init__(self, spec: InstanceSpec, cfg: ModelConfig, layout: RowLayout, cost: StepCost, loop: EventLoop,
                 record_chunks: bool = True, host: HostCores | None = None) -> None:
        self.spec = spec
        self.host = host or HostCores(None)
        self.host.instances.append(self)
        self.ranks = max(spec.tp, spec.dcp)
        self.layout = layout
        self.cost = cost
        self.loop = loop
        self.record_chunks = record_chunks
        self.pool = TimelessRowPool(layout, cfg, spec.num_rows)
        self.cache = ObservedPrefixCache(self.pool, layout.block_size,
                                         f"{spec.fingerprint}:{layout.fingerprint}".encode(), spec.prefix_cache)
        self.reports = SessionReports(self.cache)
        self.pool.spare = self.cache
        # Rows for prompt + max_tokens at admission (no growth, no preemption): the simulation advances a request
        # by many tokens per event, so it cannot take rows token by token as the engine does.
        self.scheduler = Scheduler(self.pool, spec.max_batch, self.cache, spec.max_step_tokens,
                                   reserve_ahead_tokens=None, decode_first_tokens=spec.decode_first_tokens)
        self.inbox: deque[Callable[[], None]] = deque()
        self.import_queue: deque[tuple[Request, Flight]] = deque()
        self.flights: dict[str, Flight] = {}
        self.sessions: OrderedDict[str, tuple[list[bytes], list]] = OrderedDict()
        self.is_busy = False
        self.segment: _Segment | None = None
        self.batch = DecodeBatch(layout.block_size, record_chunks)
        self.busy_s = 0.0
        self.num_steps = 0

    # ---- commands (the cluster calls these) ----
    def _command(self, fn: Callable[[], None]) -> None:
        self.inbox.append(fn)
        if self.segment is not None:
            self._cut_segment()
        elif not self.is_busy:
            self.is_busy = True
            self.loop.at(self.loop.now, self._begin)

    def _request(self, rid: str, prompt: TokenRuns, max_tokens: int, export: bool, session: str) -> Request:
        req = SimRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, export=export,
                      session=session)
        req.output_token_ids = TokenRuns()
        return req

    def submit(self, rid: str, prompt: TokenRuns, max_tokens: int, flight: Flight, export: bool = False,
               session: str = "") -> None:
        """A local prefill (+ decode, or export on a prefill node): `Engine.add_request`."""
        def run() -> None:
            req = self._request(rid, prompt, 1 if export else max_tokens, export, session)
            self.flights[rid] = flight
            self.scheduler.add(req)
        self._command(run)

    def submit_import(self, rid: str, prompt: TokenRuns, max_tokens: int, flight: Flight, session: str = "") -> None:
        """An import: rows now (`Engine.allocate_for_import`), or the node's import queue when short of rows."""
        def run() -> None:
            req = self._request(rid, prompt, max_tokens, False, session)
            self.flights[rid] = flight
            if self.import_queue or not self._try_import(req, flight):
                self.import_queue.append((req, flight))
        self._command(run)

    def _try_import(self, req: Request, flight: Flight) -> bool:
        try:
            table = self.scheduler.add_imported(req, len(req.prompt_token_ids))
        except OutOfRows:
            return False
        reused_blocks = req.num_cached_tokens // self.layout.block_size
        num_rows = len(table.attn_row_ids) - reused_blocks + len(table.kda_row_ids)
        # rows past the prompt (room for the output) are not read
        num_prompt_blocks = -(-len(req.prompt_token_ids) // self.layout.block_size)
        num_read = max(0, num_prompt_blocks - reused_blocks) + len(table.kda_row_ids)
        assert flight.on_imported is not None and num_rows >= num_read
        flight.on_imported(self.loop.now, num_read, req.num_cached_tokens)
        return True

    def start_decode(self, rid: str) -> None:
        """The READ finished: `Engine.start_decode` (the prefill node's first token is emitted now)."""
        def run() -> None:
            req = self.scheduler.requests[rid]
            assert req.state == RequestState.IMPORTING
            n = len(req.prompt_token_ids)
            req.num_computed = n
            self.scheduler.publish(req, n, snapshot=n % self.layout.block_size == 0)
            self.scheduler.keep_prompt_state(req)
            self._first_token(req, deferred=True)
        self._command(run)

    def release(self, rid: str, generation: int) -> None:
        """The reader's DONE arrived: the export's rows are freed (`Engine.release(..., reads_done=True)`)."""
        self._command(lambda: self.scheduler.release(rid, generation))

    # ---- the step loop ----
    def _retry_imports(self) -> None:
        while self.import_queue and self._try_import(*self.import_queue[0]):
            self.import_queue.popleft()

    def _begin(self) -> None:
        now = self.loop.now
        while self.inbox:
            self.inbox.popleft()()
        self.pool.reclaim(now)
        self.cache.now = now
        self._retry_imports()
        sched = self.scheduler
        if not sched.has_work:
            self.is_busy = False
            return
        plan = sched.schedule()
        if plan.prefill is None and not plan.decode:
            self.is_busy = False  # waiting for rows: a command (finish elsewhere, release) wakes it
            return
        assert len(plan.decode) == len(self.batch), "the lazily counted batch is the scheduler's decode batch"
        if plan.prefill is None:
            self._start_segment()
            return
        req, end = plan.prefill, plan.prefill_end
        duration = self.cost.step_s(end - req.num_computed, end, len(self.batch), self.batch.context())
        duration *= self.cost.stretched(self.host.start(self.ranks, self))
        has_decode = bool(plan.decode)
        self.loop.after(duration, lambda: self._end_step(req, end, has_decode, now))

    def _end_step(self, req: Request, end: int, has_decode: bool, t0: float) -> None:
        """`Engine.step` after a step with a prefill chunk (and the decode batch, when it had one)."""
        now = self.loop.now
        self.host.end(self.ranks, self)
        self._account(t0, now, 1)
        sched = self.scheduler
        n = len(req.prompt_token_ids)
        req.num_computed = end
        sched.publish(req, end, snapshot=end == sched.snapshot_boundary(req) > 0)
        if end >= n:
            sched.prefill_done(req)
            sched.keep_prompt_state(req)
        if has_decode:
            self._handle(self.batch.advance([now]))
        if end >= n:
            if req.export:
                req.output_token_ids = req.output_token_ids.extended(self.flights[req.request_id].out_uid, 1)
                self._remember(req)
                sched.export(req)
                flight = self.flights.pop(req.request_id)
                assert flight.on_exported is not None
                flight.on_exported(now, req.num_cached_tokens, req.generation)
            else:
                self._first_token(req)
        self._begin()

    def _account(self, t0: float, t1: float, steps: int) -> None:
        self.busy_s += t1 - t0
        self.num_steps += steps

    def _extend(self, req: Request, count: int) -> None:
        if count > 0:
            req.output_token_ids = req.output_token_ids.extended(self.flights[req.request_id].out_uid, count)

    def _first_token(self, req: Request, deferred: bool = False) -> None:
        """`start_running` and the first token (prefilled here, or the prefill node's after an import). A prefilled
        token is sent now, at the end of its step; an imported one (`deferred`) leaves with the round's events,
        after the step that follows `StartDecode`, which decodes the request's second token."""
        self.scheduler.start_running(req)
        flight = self.flights[req.request_id]
        self._extend(req, 1)
        is_done = len(req.output_token_ids) >= req.sampling.max_tokens
        joins = not is_done and len(self.scheduler.running) <= self.scheduler.max_batch
        if not (deferred and joins):
            flight.on_tokens([self.loop.now], 1)
        if is_done:
            self._finish(req, flight)
        elif joins:
            self.batch.join(req, deferred)

    def _catch_up(self, rid: str) -> Request:
        req, count, times, num_sent = self.batch.catch_up(rid)
        if count:
            self._extend(req, count)
            self.flights[rid].on_tokens(times, num_sent)
        return req

    def _handle(self, due: list[tuple[int, str, int]]) -> None:
        """Events of the decode batch at this step: publish a block, or end a request at max_tokens."""
        for kind, rid, boundary in due:
            req = self._catch_up(rid)
            if kind == BOUNDARY:
                self.scheduler.publish(req, boundary, snapshot=True)
                self.batch.after_boundary(req)
            else:
                self.batch.leave(rid)
                self._finish(req, self.flights[rid])

    def _finish(self, req: Request, flight: Flight) -> None:
        """At max_tokens: `keep_tail`, remember the session, `finish` (`Engine._append`); the request next in line
        moves up into the decode batch."""
        tails = self.scheduler.keep_tail(req)
        self._remember(req, tails)
        self.scheduler.finish(req, "length")
        del self.flights[req.request_id]
        running, cap = self.scheduler.running, self.scheduler.max_batch
        if len(running) >= cap and running[cap - 1].request_id not in self.batch.members:
            self.batch.join(running[cap - 1])
        if flight.on_finished is not None:
            flight.on_finished(self.loop.now, req)
        self._retry_imports()

    def _remember(self, req: Request, tails: list | None = None) -> None:
        """`Engine._remember_session`: what the cache report says per session."""
        if not req.session or not self.cache.enabled:
            return
        record = (list(req.block_keys), tails or [])
        self.reports.remember(req.session, self.sessions.get(req.session), *record)
        self.sessions[req.session] = record
        self.sessions.move_to_end(req.session)
        while len(self.sessions) > MAX_SESSIONS:
            self.reports.forget(*self.sessions.popitem(last=False))

    # ---- decode segments ----
    def _start_segment(self) -> None:
        now = self.loop.now
        batch = self.batch
        next_event = batch.next_event_step()
        assert next_event is not None and next_event > batch.steps
        steps = next_event - batch.steps
        stretch = self.cost.stretched(self.host.start(self.ranks, self))
        first = self.cost.step_s(batch=len(batch), sum_context=batch.context()) * stretch
        growth = self.cost.decode_ctx_s * len(batch) * stretch
        quarantine = [q.until for q in self.pool._quarantine]
        if quarantine:  # a reclaim may free rows for the queue head: stop at the first step past it
            steps = min(steps, max(1, self._steps_within(first, growth, min(quarantine) - now) + 1))
        seg = _Segment(now, first, growth, steps)
        seg.event = self.loop.at(now + self._elapsed(seg, steps), self._end_segment)
        self.segment = seg

    @staticmethod
    def _cumulative(first: float, growth: float, steps: int) -> float:
        return steps * first + growth * steps * (steps - 1) / 2

    def _elapsed(self, seg: _Segment, steps: int) -> float:
        return self._cumulative(seg.first_s, seg.growth_s, steps)

    def _steps_within(self, first: float, growth: float, span: float) -> int:
        """The most whole steps that end within `span` seconds."""
        if span <= 0:
            return 0
        if growth <= 0:
            return int(span // first) if first > 0 else 1 << 40
        a, b = growth / 2, first - growth / 2  # growth/2 j^2 + (first - growth/2) j <= span
        j = int((-b + math.sqrt(b * b + 4 * a * span)) / (2 * a))
        while j > 0 and self._cumulative(first, growth, j) > span:
            j -= 1
        while self._cumulative(first, growth, j + 1) <= span:
            j += 1
        return j

    def _cut_segment(self) -> None:
        """A command arrived mid-segment: end it at the boundary of the step in progress."""
        seg = self.segment
        assert seg is not None and seg.event is not None
        done = self._steps_within(seg.first_s, seg.growth_s, self.loop.now - seg.t0)
        steps = min(seg.num_steps, done + 1)
        if steps == seg.num_steps:
            return
        seg.event.cancel()
        seg.num_steps = steps
        seg.event = self.loop.at(seg.t0 + self._elapsed(seg, steps), self._end_segment)

    def _end_segment(self) -> None:
        seg = self.segment
        assert seg is not None
        self.segment = None
        self.host.end(self.ranks, self)
        self._account(seg.t0, self.loop.now, seg.num_steps)
        if self.record_chunks:
            times = [seg.t0 + self._elapsed(seg, j) for j in range(1, seg.num_steps + 1)]
        else:  # the first step exactly (a request joins at a segment's start; its deferred token leaves then)
            times = [seg.t0 + seg.first_s] + [self.loop.now] * (seg.num_steps - 1)
        self._handle(self.batch.advance(times))
        self._begin()

    # ---- what the router polls ----
    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage) as the node's /metrics report them."""
        sched = self.scheduler
        used = 1.0 - self.pool.num_available / max(1, self.pool.num_usable)
        return sched.num_running, sched.num_waiting + len(self.import_queue), used

    def cache_report(self) -> CacheReport:
        """`Engine.cache_report` as the router's poll parses it (per-session figures kept by `SessionReports`)."""
        cache = self.cache
        held, resumable = self.reports.report(self.sessions)
        return CacheReport(
            block_tokens=self.layout.block_size, fingerprint="sim", sessions=held, resumable=resumable,
            blocks_cached=cache.num_blocks, rows_free=self.pool.num_free, hits_tokens=cache.counters.hit_tokens,
            queried_tokens=cache.counters.queried_tokens, evicted_blocks=cache.counters.evicted_blocks,
            tails=cache.enabled and self.scheduler.resume)
