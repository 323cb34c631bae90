"""Circuit breakers, one per instance and one per P-D link.

closed -> (failure_threshold consecutive failures) -> open -> (recovery_s later) -> half-open: one trial
request is let through; its success closes the breaker, its failure opens it again.

Every request through a breaker is an `Attempt` (`CircuitBreaker.attempt`), and every attempt ends exactly once:
`succeeded`, `failed` or `neutral` (the node shed it, the client left, the leg was cancelled: nothing learnt about
health). Ending an attempt again does nothing, so a caller ends it where the outcome is known and also, as a
backstop, `neutral()` in a `finally`: whatever path a leg takes (a streamed answer relayed to its end, a
cancellation, an unexpected exception), its attempt is over when the leg is. The half-open trial is the attempt
the breaker handed out while half-open; only its own end frees the trial slot, so the state machine cannot stay
blocked past `recovery_s` with no trial in flight (tests/router/test_breaker_property.py drives random
sequences). A trial attempt dropped without an end (a bug) is ended neutral when it is garbage-collected, with a
warning.

Time is passed in (`now`) so the state machine is tested without sleeping. `Breakers.tripped` holds the keys of
every breaker that is not closed, so the hot path skips breaker checks entirely while all are closed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

log = logging.getLogger("router")


class Attempt:
    """One request through one breaker; the first of `succeeded` / `failed` / `neutral` ends it, later calls do
    nothing."""

    __slots__ = ("breaker", "trial_token", "is_ended", "__weakref__")

    def __init__(self, breaker: CircuitBreaker, trial_token: object | None = None) -> None:
        self.breaker = breaker
        self.trial_token = trial_token
        """Set on the half-open trial: the breaker's mark of it."""
        self.is_ended = False

    @property
    def is_trial(self) -> bool:
        return self.trial_token is not None

    def succeeded(self) -> None:
        if self._end():
            self.breaker._record_success()

    def failed(self, now: float) -> None:
        if self._end():
            self.breaker._record_failure(now)

    def neutral(self) -> None:
        """Nothing learnt about health (shed, client gone, leg cancelled): only the trial slot is freed."""
        self._end()

    def _end(self) -> bool:
        if self.is_ended:
            return False
        self.is_ended = True
        if self.trial_token is not None and self.breaker._trial_token is self.trial_token:
            self.breaker._trial_token = None
        return True


def _lost_trial(breaker_ref: weakref.ref, token: object) -> None:
    """A trial attempt was garbage-collected without an end: free its slot (neutral) and say so."""
    breaker = breaker_ref()
    if breaker is not None and breaker._trial_token is token:
        log.warning("router: the half-open trial of breaker %s was dropped without an outcome; freed", breaker.key)
        breaker._trial_token = None


@dataclass(eq=False)
class CircuitBreaker:
    failure_threshold: int
    recovery_s: float
    num_failures: int = 0
    opened_at: float | None = None
    key: object = None
    tripped: set | None = None
    """The owner's set of keys of breakers that are not closed (kept current here)."""
    _trial_token: object | None = None
    """Identifies the half-open trial in flight (None: none); the trial attempt itself is not held, so that a
    dropped one can be collected and its finalizer free the slot."""

    @property
    def is_trial_inflight(self) -> bool:
        return self._trial_token is not None

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if now - self.opened_at >= self.recovery_s else "open"

    def allows(self, now: float) -> bool:
        """May a request use this instance/link now (does not reserve the half-open trial)?"""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and self._trial_token is None)

    def attempt(self, now: float) -> Attempt:
        """Start a request through this breaker: the half-open trial when the breaker is half-open and no trial
        is in flight. The caller ends the attempt exactly once (`Attempt`)."""
        if self.opened_at is None or self._trial_token is not None or self.state(now) != "half_open":
            return Attempt(self)
        token = self._trial_token = object()
        attempt = Attempt(self, token)
        weakref.finalize(attempt, _lost_trial, weakref.ref(self), token)
        return attempt

    def _record_success(self) -> None:
        self.num_failures = 0
        self.opened_at = None
        if self.tripped is not None:
            self.tripped.discard(self.key)

    def reset(self) -> None:
        """Back to closed with no failure counted (the trial slot freed: a trial still running ends as a plain
        attempt)."""
        self._trial_token = None
        self._record_success()

    def _record_failure(self, now: float) -> None:
        self.num_failures += 1
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

    def recovered(self, name: str) -> None:
        """`name` came back healthy after its health checks had failed (a restarted node): its breaker and the
        breakers of its links close. The failures that opened them were what health then saw (a node gone), and
        a half-open breaker lets one request through until that request ends: a stream can take minutes, during
        which no other request, nor a stream moving off another failed instance, could be placed there."""
        for key in [name, *(key for key in self.links if name in key)]:
            breaker = self.instances.get(key) if isinstance(key, str) else self.links.get(key)
            if breaker is not None:
                breaker.reset()

    def link(self, prefill: str, decode: str) -> CircuitBreaker:
        key = (prefill, decode)
        breaker = self.links.get(key)
        if breaker is None:
            breaker = self.links[key] = CircuitBreaker(self.failure_threshold, self.recovery_s, key=key,
                                                       tripped=self.tripped)
        return breaker
