"""The node-private framing of a round: what the driver sends every rank (`StepPlan`: the round's commands) and
what each rank answers (`StepReply`: its events and `RankStats`). The commands and events themselves are the
engine's API (engine/api.py). Frozen, picklable dataclasses; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.api import Command, Event


@dataclass(frozen=True)
class RankStats:
    """One rank's load after a round."""

    num_running: int = 0
    num_waiting: int = 0
    num_rows_used: int = 0
    num_rows_total: int = 0
    has_work: bool = False
    counters: tuple[tuple[str, float], ...] = ()
    """Cumulative counters (name, total) since the rank started."""
    timings: tuple[tuple[str, str, float], ...] = ()
    """Durations measured since the last round (name, label, seconds), e.g. ("prefill", "token", 1.2)."""
    cache: Any = None
    """Rank 0's prefix-cache report (engine.engine.CacheReport) when it changed since the last round, else None."""


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
