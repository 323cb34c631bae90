"""Circuit breakers, one per instance and one per P-D link.

closed -> (failure_threshold consecutive failures) -> open -> (recovery_s later) -> half-open: one trial
request is let through; its success closes the breaker, its failure opens it again. Time is passed in
(`now`) so the state machine is tested without sleeping. `Breakers.tripped` holds the keys of every
breaker that is not closed, so the hot path skips breaker checks entirely while all are closed.
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
    key: object = None
    tripped: set | None = None
    """The owner's set of keys of breakers that are not closed (kept current here)."""

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
        if self.tripped is not None:
            self.tripped.discard(self.key)

    def on_neutral(self) -> None:
        """An attempt that says nothing about health (the node shed it with Retry-After): frees the
        half-open trial, counts neither way."""
        self.is_trial_inflight = False

    def on_failure(self, now: float) -> None:
        self.num_failures += 1
        self.is_trial_inflight = False
        if self.opened_at is not None or self.num_failures >= self.failure_threshold:
            self.opened_at = now
            if self.tripped is not None:
                self.tripped.add(self.key)


@dataclass
class Breakers:
    """All breakers of a router, created on first use."""

    failure_threshold: int
    recovery_s: float
    instances: dict[str, CircuitBreaker] = field(default_factory=dict)
    links: dict[tuple[str, str], CircuitBreaker] = field(default_factory=dict)
    tripped: set = field(default_factory=set)
    """Keys (an instance name, or a (prefill, decode) link) of breakers that are open or half-open."""

    def instance(self, name: str) -> CircuitBreaker:
        breaker = self.instances.get(name)
        if breaker is None:
            breaker = self.instances[name] = CircuitBreaker(self.failure_threshold, self.recovery_s, key=name,
                                                            tripped=self.tripped)
        return breaker

    def link(self, prefill: str, decode: str) -> CircuitBreaker:
        key = (prefill, decode)
        breaker = self.links.get(key)
        if breaker is None:
            breaker = self.links[key] = CircuitBreaker(self.failure_threshold, self.recovery_s, key=key,
                                                       tripped=self.tripped)
        return breaker
