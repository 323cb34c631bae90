"""The node-private framing of a round: what the driver sends every rank (`StepPlan`: the round's commands) and
what each rank answers (`StepReply`: its events and `RankStats`). The commands, events and `RankStats` themselves are
the engine's API (engine/api.py). Frozen, picklable dataclasses; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import Command, Event, RankStats


@dataclass(frozen=True)
class StepPlan:
    round_id: int
    commands: tuple[Command, ...]
    run_step: bool = True
    now: float = 0.0
    """The driver's clock (time.monotonic) for this round: ranks measure quarantines in it, so they agree."""


@dataclass(frozen=True)
class StepReply:
    rank: int
    events: list[Event]
    stats: RankStats
