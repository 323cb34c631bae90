"""Prefill-side leases: the one owner of an export's rows from the moment the node grants it until it ends.

A prefill node that finished a request keeps its rows (attention + KDA) under a lease instead of freeing them,
and puts `lease_id` / `lease_expiry` in the kv_transfer_params it returns. A lease names its export by
`ExportKey(request_id, generation)`, never by row ids: whatever ends it, the node releases exactly that export,
so a lease that outlived its export (the request was aborted and its rows reused) frees nothing of anyone else's.
The lease ends exactly once:
- `notified`: every expected READ reported done (D sends one notification per READ, see `done_message`);
- `aborted`: the node gave up on the request (client gone), or the reader said it will not read
  (`abort(lease_id, by_reader=True)`, `abort_message`: D sends it only once none of its READs can still run);
- `expired`: the deadline passed (`expire(now)`, called by the node's loop) - covers a reader that died.
Every end calls `on_end(lease, outcome)` once; `lease.reads_done` says no READ can still target the rows (every
READ notified, or the reader aborted), else the node quarantines them. Notifications for leases that already ended are counted as `late` and
ignored. Counters: `outcomes` (notified/aborted/expired), `late_notifications`; `outstanding` = live leases
(metric `pdcluster_node_leases_outstanding`).

Notification wire format (NIXL notif bytes, UTF-8): `DONE:<lease_id>:<consumer>:<total>`, `ABORT:<lease_id>`.
`apply_message(msg)` routes one. The manager is thread-safe; `clock` is injectable (default time.time, the wall
clock shared with D).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

OUTCOMES = ("notified", "aborted", "expired")


@dataclass(frozen=True)
class ExportKey:
    """One export of one request: the engine's request id and its per-export generation."""

    request_id: str
    generation: int


@dataclass
class Lease:
    lease_id: str
    export: ExportKey
    expiry: float
    consumers_seen: set[str] = field(default_factory=set)
    reads_done: bool = False
    """Set when the lease ends notified or aborted by its reader: no READ of it can still be running."""


def done_message(lease_id: str, consumer: str, total: int) -> bytes:
    return f"DONE:{lease_id}:{consumer}:{total}".encode()


def abort_message(lease_id: str) -> bytes:
    return f"ABORT:{lease_id}".encode()


class LeaseManager:
    """Leases of one prefill instance's exports (see the module docstring)."""

    def __init__(self, on_end: Callable[[Lease, str], None], ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self._on_end = on_end
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.late_notifications = 0

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._leases)

    def create(self, export: ExportKey, lease_id: str | None = None) -> Lease:
        """Hold `export`'s rows for a reader until notified, aborted or expired."""
        lease = Lease(lease_id or uuid.uuid4().hex, export, self._clock() + self.ttl_s)
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id} already exists")
            self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def _end(self, lease_id: str, outcome: str, reads_done: bool = False) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            lease.reads_done = reads_done
            self.outcomes[outcome] += 1
        self._on_end(lease, outcome)
        return True

    def notify_done(self, lease_id: str, consumer: str, total: int) -> bool:
        """Record one reader's completion; ends the lease when `total` distinct consumers reported.
        True when this call ended the lease."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                self.late_notifications += 1
                return False
            lease.consumers_seen.add(consumer)
            complete = len(lease.consumers_seen) >= total
        return complete and self._end(lease_id, "notified", reads_done=True)

    def abort(self, lease_id: str, by_reader: bool = False) -> bool:
        """End a lease early; `by_reader`: the reader says none of its READs can still run."""
        return self._end(lease_id, "aborted", reads_done=by_reader)

    def expire(self, now: float | None = None) -> list[str]:
        """End every lease past its deadline; the ids ended."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expiry <= now]
        return [lid for lid in due if self._end(lid, "expired")]

    def apply_message(self, msg: bytes) -> None:
        """Route one notification (DONE / ABORT); malformed ones raise ValueError."""
        text = msg.decode(errors="replace")
        kind, _, rest = text.partition(":")
        if kind == "DONE":
            parts = rest.split(":")
            if len(parts) != 3 or not parts[2].isdigit():
                raise ValueError(f"malformed DONE notification {text!r}")
            self.notify_done(parts[0], parts[1], int(parts[2]))
        elif kind == "ABORT" and rest:
            if not self.abort(rest, by_reader=True):
                self.late_notifications += 1
        else:
            raise ValueError(f"unknown notification {text!r}")
