"""Circuit breakers, one per instance and one per P-D link.

closed -> (failure_threshold consecutive failures) -> open -> (recovery_s later) -> half-open: one trial
request is let through; its success closes the breaker, its failure opens it again. Time is passed in
(`now`) so the state machine is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CircuitBreaker:
    failure_threshold: int
    recovery_s: float
    num_failures: int = 0
    opened_at: float | None = None
    is_trial_inflight: bool = False

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if now - self.opened_at >= self.recovery_s else "open"

    def allows(self, now: float) -> bool:
        """May a request use this instance/link now (does not reserve the half-open trial)?"""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.is_trial_inflight)

    def on_attempt(self, now: float) -> None:
        if self.state(now) == "half_open":
            self.is_trial_inflight = True

    def on_success(self) -> None:
        self.num_failures = 0
        self.opened_at = None
        self.is_trial_inflight = False

    def on_failure(self, now: float) -> None:
        self.num_failures += 1
        self.is_trial_inflight = False
        if self.opened_at is not None or self.num_failures >= self.failure_threshold:
            self.opened_at = now


@dataclass
class Breakers:
    """All breakers of a router, created on first use."""

    failure_threshold: int
    recovery_s: float
    instances: dict[str, CircuitBreaker] = field(default_factory=dict)
    links: dict[tuple[str, str], CircuitBreaker] = field(default_factory=dict)

    def instance(self, name: str) -> CircuitBreaker:
        if name not in self.instances:
            self.instances[name] = CircuitBreaker(self.failure_threshold, self.recovery_s)
        return self.instances[name]

    def link(self, prefill: str, decode: str) -> CircuitBreaker:
        key = (prefill, decode)
        if key not in self.links:
            self.links[key] = CircuitBreaker(self.failure_threshold, self.recovery_s)
        return self.links[key]
