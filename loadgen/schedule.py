"""The request stream a scenario plans: sessions of steps, each step a request or a fork of sub-agents.

Everything here is immutable and a pure function of the scenario's config and seed, so the same seed
gives the same stream; `schedule_hash` condenses a stream into one hex digest that reports carry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Protocol, Union


@dataclass(frozen=True)
class Message:
    """One chat message; `content` is synthetic text of `num_tokens` words."""

    role: str
    content: str
    num_tokens: int


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `think_s` is the pause before sending (tool time); `arrival_s` is the
    trace's send time from the level start (open-loop replay), None for closed-loop scenarios."""

    request_id: str
    messages: tuple[Message, ...]
    max_tokens: int
    session_id: str | None = None
    think_s: float = 0.0
    arrival_s: float | None = None
    cancel_after_tokens: int | None = None

    @cached_property
    def num_input_tokens(self) -> int:
        """Tokens of all messages (computed once: a session's later turns carry many messages)."""
        return sum(m.num_tokens for m in self.messages)

    def prompt(self) -> str:
        """The messages joined for the completions endpoint."""
        return "\n".join(m.content for m in self.messages)


@dataclass(frozen=True)
class Fork:
    """Parallel sub-agents: every branch runs concurrently; the parent resumes when all are done."""

    branches: tuple[tuple["Step", ...], ...]


Step = Union[RequestSpec, Fork]


@dataclass(frozen=True)
class Session:
    """One unit of closed-loop work: a session's steps, run in order by one concurrency slot."""

    session_id: str
    steps: tuple[Step, ...] = field(default_factory=tuple)

    def requests(self) -> list[RequestSpec]:
        """Every request of the session in planning order (fork branches depth-first)."""
        return list(_walk(self.steps))


def _walk(steps: Iterable[Step]) -> Iterable[RequestSpec]:
    for step in steps:
        if isinstance(step, Fork):
            for branch in step.branches:
                yield from _walk(branch)
        else:
            yield step


class Workload(Protocol):
    """A scenario: `session(k)` is unit k of the stream (None once a finite stream ends)."""

    name: str
    is_open_loop: bool

    def session(self, index: int) -> Session | None: ...

    def describe(self) -> dict[str, str]: ...


def _update(digest: "hashlib._Hash", spec: RequestSpec) -> None:
    head = (spec.request_id, spec.session_id, spec.max_tokens, round(spec.think_s, 6), spec.arrival_s,
            spec.cancel_after_tokens)
    digest.update(repr(head).encode())
    for msg in spec.messages:
        digest.update(msg.role.encode() + b"\x00" + msg.content.encode() + b"\x01")


def schedule_hash(workload: Workload, num_units: int) -> str:
    """sha256 over the workload's config and its first `num_units` units (fewer if the stream ends)."""
    digest = hashlib.sha256(repr(sorted(workload.describe().items())).encode())
    for index in range(num_units):
        session = workload.session(index)
        if session is None:
            break
        digest.update(f"session:{session.session_id}".encode())
        for spec in session.requests():
            _update(digest, spec)
    return digest.hexdigest()
