"""Continuous batching: request states, the prefill queue and the decode batch. No torch, no model.

States: WAITING (prefill queue) -> RUNNING (decode batch) -> FINISHED; with export: WAITING -> EXPORTED (prefill
done, rows kept for a remote reader until released); with import: IMPORTING (rows allocated, an external writer
fills them) -> RUNNING once `start_decode` gives the first token.
An export is named by its request id AND its `generation` (a per-scheduler counter stamped when the prefill is
done): `release(request_id, generation)` ends only that export, so a stale release of an earlier request with the
same id, or of rows that have since been reused, frees nothing. Ending a request whose rows a remote READ may
still target (EXPORTED or IMPORTING; `finish(..., quarantine_until=t)`) quarantines its rows instead of freeing
them (engine.cache.RowPool.quarantine); a `held` request's rows stay quarantined for good.
`Scheduler.schedule()` picks, per engine step, at most one waiting request to prefill (first in, first out; it
waits while the pool lacks rows for its prompt + max_tokens) and every running request (up to max_batch) to
decode. Rows are allocated when a request is admitted, for its prompt plus max_tokens, so a running request never
runs out of rows; they return to the pool when it finishes, is aborted, or its export is released.
The scheduler is deterministic: the same commands in the same order give the same batches and row ids.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from engine.cache import BlockTable, RowPool
from engine.sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    EXPORTED = "exported"
    IMPORTING = "importing"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    export: bool = False
    state: RequestState = RequestState.WAITING
    generation: int = 0
    """Set when the request is exported (unique within the scheduler); releases must name it."""
    held: bool = False
    """A READ into its rows could not be cancelled: when it ends, its rows stay quarantined for good."""
    table: BlockTable | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is (or is about to be) in the cache: prompt + outputs so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def capacity(self) -> int:
        """Tokens the rows must hold: the prompt, plus max_tokens unless the rows go to a remote decoder."""
        return len(self.prompt_token_ids) + (0 if self.export else self.sampling.max_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    prefill: Request | None
    decode: tuple[Request, ...]


class Scheduler:
    def __init__(self, pool: RowPool, max_batch: int = 64) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._generations = 0

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        num_attn, num_kda = self.pool.rows_for(req.capacity)
        if num_attn + num_kda > self.pool.num_rows:
            raise ValueError(f"request {req.request_id!r} needs {num_attn + num_kda} rows for {req.capacity} tokens;"
                             f" the pool has {self.pool.num_rows}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_imported(self, req: Request, num_tokens: int, zero_kda: bool = False) -> BlockTable:
        """Admit a request outside the queue (its first num_tokens tokens arrive from elsewhere, or it prefills
        right now); rows are allocated at once. Raises engine.cache.OutOfRows when the pool is short."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.table = self.pool.allocate_request(max(req.capacity, num_tokens), zero_kda=zero_kda)
        req.state = RequestState.IMPORTING
        self.requests[req.request_id] = req
        return req.table

    def start_running(self, req: Request) -> None:
        req.state = RequestState.RUNNING
        self.running.append(req)

    def schedule(self) -> SchedulerOutput:
        prefill = None
        if self.waiting:
            head = self.waiting[0]
            num_attn, num_kda = self.pool.rows_for(head.capacity)
            if num_attn + num_kda <= self.pool.num_free:
                prefill = self.waiting.popleft()
                prefill.table = self.pool.allocate_request(prefill.capacity)
        return SchedulerOutput(prefill, tuple(self.running[: self.max_batch]))

    def finish(self, req: Request, reason: str, quarantine_until: float | None = None) -> None:
        """End a request in any state; its rows are freed, or quarantined until `quarantine_until`."""
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.state == RequestState.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED
        self._free(req, quarantine_until)
        self.requests.pop(req.request_id, None)

    def export(self, req: Request) -> None:
        """The prefill of an export request is done: keep its rows, stop scheduling it, stamp its generation."""
        req.state = RequestState.EXPORTED
        self._generations += 1
        req.generation = self._generations
        if req in self.running:
            self.running.remove(req)

    def release(self, request_id: str, generation: int, quarantine_until: float | None = None) -> bool:
        """End export `generation` of `request_id`; False (nothing freed) if that export is not live."""
        req = self.requests.get(request_id)
        if req is None or req.state != RequestState.EXPORTED or req.generation != generation:
            return False
        self.finish(req, "released", quarantine_until)
        return True

    def _free(self, req: Request, quarantine_until: float | None = None) -> None:
        if req.table is None:
            return
        if req.held:
            quarantine_until = math.inf
        if quarantine_until is None:
            self.pool.free(req.table.row_ids)
        else:
            self.pool.quarantine(req.table.row_ids, quarantine_until, req.request_id)
        req.table = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
