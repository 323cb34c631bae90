"""A rank worker for executor tests of the import merge (no engine, no transport): rank r answers an `ImportKV`
1 + 30 * r rounds after it, with `num_bytes` = 100 * (r + 1); rank 1 reports an uncancelled READ for request ids
starting with "stuck". Its `held` counter counts the `HoldRows` commands it applied."""

from __future__ import annotations

from typing import Any

from engine.api import Command, Event, HoldRows, ImportKV, ImportOutcome, RankStats, StartDecode, TokenEvent

ROUNDS_PER_RANK = 30


class StaggeredImports:
    def __init__(self, config: Any, ctx: Any) -> None:
        self.rank = ctx.rank
        self.pending: dict[str, int] = {}
        self.held: list[str] = []

    def startup_info(self) -> None:
        return None

    def begin_round(self, now: float) -> None:
        pass

    def apply(self, cmd: Command) -> list[Event]:
        if isinstance(cmd, ImportKV):
            self.pending[cmd.request_id] = 1 + ROUNDS_PER_RANK * self.rank
        elif isinstance(cmd, HoldRows):
            self.held.append(cmd.request_id)
        elif isinstance(cmd, StartDecode):
            return [TokenEvent(request_id=cmd.request_id, token_id=1, finish_reason="length")]
        return []

    def step(self) -> list[Event]:
        events: list[Event] = []
        for request_id in list(self.pending):
            self.pending[request_id] -= 1
            if self.pending[request_id] <= 0:
                del self.pending[request_id]
                stuck = request_id.startswith("stuck") and self.rank == 1
                events.append(ImportOutcome(request_id=request_id, num_bytes=100 * (self.rank + 1),
                                            error="rank 1: stalled" if stuck else None, uncancelled=stuck))
        return events

    def stats(self) -> RankStats:
        return RankStats(counters=(("held", float(len(self.held))),))

    def close(self) -> None:
        pass


def build(config: Any, ctx: Any) -> StaggeredImports:
    return StaggeredImports(config, ctx)
