"""Prefill-side leases on exported rows: nothing a reader may still read is freed, nothing leaks.

A prefill node that finished a request keeps its rows (attention + KDA) under a lease instead of freeing
them, and puts `lease_id` / `lease_expiry` in the kv_transfer_params it returns. The lease ends exactly once:
- `notified`: every expected READ reported done (D sends one notification per READ, see `done_message`);
- `aborted`: the node gave up on the request (client gone, D told it so with `abort_message`);
- `expired`: the deadline passed (`expire(now)`, called by the node's loop) - covers a reader that died.
`heartbeat(lease_id)` (D sends `heartbeat_message` while it waits to be scheduled) pushes the deadline to
`now + ttl`. Every end calls the `free_rows(rows)` callback once. Notifications for leases that already ended
are counted as `late` and ignored. Counters: `outcomes` (notified/aborted/expired), `late_notifications`,
`heartbeats`; `outstanding` = live leases (metric `pdcluster_node_leases_outstanding`).

Notification wire format (NIXL notif bytes, UTF-8): `DONE:<lease_id>:<consumer>:<total>`,
`HB:<lease_id>`, `ABORT:<lease_id>`. `apply_message(msg)` routes one.
The manager is thread-safe; `clock` is injectable (default time.time, the wall clock shared with D).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

OUTCOMES = ("notified", "aborted", "expired")


@dataclass
class Lease:
    lease_id: str
    rows: tuple[int, ...]
    expiry: float
    consumers_seen: set[str] = field(default_factory=set)


def done_message(lease_id: str, consumer: str, total: int) -> bytes:
    return f"DONE:{lease_id}:{consumer}:{total}".encode()


def heartbeat_message(lease_id: str) -> bytes:
    return f"HB:{lease_id}".encode()


def abort_message(lease_id: str) -> bytes:
    return f"ABORT:{lease_id}".encode()


class LeaseManager:
    """Leases of one prefill instance's pool (see the module docstring)."""

    def __init__(self, free_rows: Callable[[tuple[int, ...]], None], ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self._free_rows = free_rows
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.late_notifications = 0
        self.heartbeats = 0

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._leases)

    def create(self, rows: list[int] | tuple[int, ...], lease_id: str | None = None) -> Lease:
        """Hold `rows` for a reader until notified, aborted or expired."""
        lease = Lease(lease_id or uuid.uuid4().hex, tuple(rows), self._clock() + self.ttl_s)
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id} already exists")
            self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def _end(self, lease_id: str, outcome: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self.outcomes[outcome] += 1
        self._free_rows(lease.rows)
        return True

    def heartbeat(self, lease_id: str) -> float | None:
        """Extend a live lease to now + ttl; the new expiry, or None if it already ended."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                self.late_notifications += 1
                return None
            self.heartbeats += 1
            lease.expiry = max(lease.expiry, self._clock() + self.ttl_s)
            return lease.expiry

    def notify_done(self, lease_id: str, consumer: str, total: int) -> bool:
        """Record one reader's completion; frees the rows when `total` distinct consumers reported.
        True when this call ended the lease."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                self.late_notifications += 1
                return False
            lease.consumers_seen.add(consumer)
            complete = len(lease.consumers_seen) >= total
        return complete and self._end(lease_id, "notified")

    def abort(self, lease_id: str) -> bool:
        return self._end(lease_id, "aborted")

    def expire(self, now: float | None = None) -> list[str]:
        """End every lease past its deadline; the ids ended."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expiry <= now]
        return [lid for lid in due if self._end(lid, "expired")]

    def apply_message(self, msg: bytes) -> None:
        """Route one notification (DONE / HB / ABORT); malformed ones raise ValueError."""
        text = msg.decode(errors="replace")
        kind, _, rest = text.partition(":")
        if kind == "DONE":
            parts = rest.split(":")
            if len(parts) != 3 or not parts[2].isdigit():
                raise ValueError(f"malformed DONE notification {text!r}")
            self.notify_done(parts[0], parts[1], int(parts[2]))
        elif kind == "HB" and rest:
            self.heartbeat(rest)
        elif kind == "ABORT" and rest:
            if not self.abort(rest):
                self.late_notifications += 1
        else:
            raise ValueError(f"unknown notification {text!r}")
