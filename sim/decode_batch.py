"""The decode batch of one simulated instance, accounted lazily: a request's outputs grow only when something
happens to it.

Every request in the engine's decode batch (`Scheduler.running[:max_batch]`) gains one token per decode step, so
its output count at step S is what it had when last brought up to date (`start` step) plus S - start. Only two
things must happen at an exact step: at a block boundary the engine publishes the block (`Scheduler.publish(req,
b, snapshot=True)`, on the step whose input position is b), and at max_tokens it ends the request (`keep_tail`,
`finish`). Those are events in a heap keyed by step; a run of decode steps ends at the first one. The batch's
summed context, which the step cost needs, is `offset + members * S`. Per step the instance records its end time,
so a request brought up to date gets one chunk time per step it decoded (or, without chunk times, only the last;
the first step of a run is always recorded exactly, for a deferred token sent then).

`join` puts a request in the batch (it started running within max_batch, or moved up into it when one ahead of it
finished); `advance(times)` runs len(times) steps and returns the due events in step order (boundary before
finish on one step, as the engine publishes before it appends). A request joined with `deferred` has a token
already counted whose event leaves with its first step's (an imported request's first token: the node's round
applies `StartDecode`, then steps, then sends the round's events together).
"""

from __future__ import annotations

import heapq
import itertools

from engine.scheduler import Request

BOUNDARY, FINISH = 0, 1


class DecodeBatch:
    def __init__(self, block_tokens: int, record_chunks: bool) -> None:
        self.block_tokens = block_tokens
        self.record_chunks = record_chunks
        self.steps = 0
        """Decode steps run so far."""
        self.step_times: list[float] = []
        self.members: dict[str, tuple[Request, int]] = {}
        """Request id -> (request, step its outputs are counted to)."""
        self.offset = 0
        """Sum over members of (tokens counted - start step): the batch's context at step S is offset + n * S."""
        self._events: list[tuple[int, int, int, str, int]] = []
        self._seq = itertools.count()
        self.deferred: set[str] = set()
        """Members whose last counted token is sent with their first step's token."""

    def __len__(self) -> int:
        return len(self.members)

    def context(self) -> int:
        return self.offset + len(self.members) * self.steps

    def next_event_step(self) -> int | None:
        while self._events:
            step, _, kind, rid, value = self._events[0]
            if self._is_live(kind, rid, value):
                return step
            heapq.heappop(self._events)
        return None

    def _is_live(self, kind: int, rid: str, value: int) -> bool:
        entry = self.members.get(rid)
        return entry is not None and (kind == FINISH or value >= entry[0].num_tokens)

    def _push_boundary(self, req: Request, start: int) -> None:
        bt = self.block_tokens
        boundary = -(-req.num_tokens // bt) * bt
        heapq.heappush(self._events, (start + boundary - req.num_tokens + 1, next(self._seq), BOUNDARY,
                                      req.request_id, boundary))

    def join(self, req: Request, deferred: bool = False) -> None:
        start = self.steps
        if deferred:
            self.deferred.add(req.request_id)
        self.members[req.request_id] = (req, start)
        self.offset += req.num_tokens - start
        left = req.sampling.max_tokens - len(req.output_token_ids)
        heapq.heappush(self._events, (start + left, next(self._seq), FINISH, req.request_id, 0))
        self._push_boundary(req, start)

    def leave(self, rid: str) -> None:
        req, start = self.members.pop(rid)
        self.offset -= req.num_tokens - start
        self.deferred.discard(rid)

    def catch_up(self, rid: str) -> tuple[Request, int, list[float], int]:
        """Bring a member's outputs up to the current step: (request, tokens added, the times its tokens were
        sent, how many tokens were sent: those added and a deferred one)."""
        req, start = self.members[rid]
        count = self.steps - start
        self.members[rid] = (req, self.steps)
        if count <= 0:
            return req, 0, [], 0
        times = self.step_times[start:self.steps] if self.record_chunks else [self.step_times[-1]]
        if rid in self.deferred:  # sent with its first step's token, at that step's end
            self.deferred.discard(rid)
            return req, count, [self.step_times[start], *times], count + 1
        return req, count, times, count

    def advance(self, times: list[float]) -> list[tuple[int, str, int]]:
        """Run len(times) decode steps ending at `times`; the events now due: (kind, request id, boundary)."""
        self.steps += len(times)
        self.step_times.extend(times)
        due = []
        while self._events and self._events[0][0] <= self.steps:
            step, _, kind, rid, value = heapq.heappop(self._events)
            if self._is_live(kind, rid, value):
                assert step == self.steps, "a run of steps must end at its first event"
                due.append((kind, rid, value))
        due.sort(key=lambda e: e[0])
        return due

    def after_boundary(self, req: Request) -> None:
        """The boundary event of a member was handled: queue its next one."""
        self._push_boundary(req, self.members[req.request_id][1])
