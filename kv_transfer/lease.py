"""Prefill-side leases: the one owner of an export's rows from the moment the node grants it until it ends.

A prefill node that finished a request keeps its rows (attention + KDA) under a lease instead of freeing them,
and puts `lease_id` / `lease_expiry` in the kv_transfer_params it returns. A lease names its export by
`ExportKey(request_id, generation)`, never by row ids: whatever ends it, the node releases exactly that export,
so a lease that outlived its export (the request was aborted and its rows reused) frees nothing of anyone else's.
The lease ends exactly once:
- `notified`: every expected READ reported done (D sends one notification per READ, see `done_message`);
- `aborted`: the node gave up on the request (client gone), or the reader that claimed it said it will not read
  (`abort_claimed`: D's signed side-channel abort, sent only once none of its READs can run);
- `expired`: the deadline passed (`expire(now)`, called by the node's loop) - covers a reader that died.
Redeemed once: before it reads, a decode node claims the lease (`claim(lease_id, reader)`, the side channel's
signed `POST /kv/leases/{id}/claim`). The first claim wins; every later one is refused (`ClaimRefused`, 409),
as is one from a reader other than the decode instance the hand-off was issued for (`Lease.reader`, 403) and one
for a lease that ended (404). So two decode nodes, a restarted one, or two concurrent presentations of one
hand-off never both import it: the prefill node, which owns the rows, is the one authority.
Bound later: a lease made before its reader is known (a stream a draining decode node moves out: its next
instance is the router's choice, made after the lease) `awaits_reader`: every claim is refused (403) until
`bind(lease_id, reader)` names the reader (the router's signed side-channel call, before it sends the params on);
the first bind wins, a bind naming another reader, or one after a claim, is refused (409).
Every end calls `on_end(lease, outcome)` once; `lease.reads_done` says no READ can still target the rows (every
READ notified, the reader aborted, or nobody claimed the lease: a decode node reads only after its claim won, and a
claim after the end is refused, so an unclaimed lease's rows are freed at once, not quarantined), else the node
quarantines them. Notifications for leases that already ended are counted as `late` and ignored. Counters: `outcomes` (notified/aborted/expired), `late_notifications`; `outstanding` = live leases
(metric `pdcluster_node_leases_outstanding`).

Notification wire format (NIXL notif bytes, UTF-8): `DONE:<lease_id>:<consumer>:<total>:<mac>`, the MAC an
HMAC-SHA256 (hex) of the rest under the lease's key (kv_transfer/signing.py `lease_key`: derived from the cluster
secret and the lease id, which the decode node hands its ranks for that import alone). Anyone on the network can
send a NIXL notification to P's agents; with a secret (`LeaseManager(secret=...)`) one whose MAC does not verify
ends nothing and is counted in `rejected_notifications`, so a forged DONE cannot free another request's rows early.
Without a secret (an insecure cluster) the MAC is empty and not checked.
`apply_message(msg)` routes one. The manager is thread-safe; `clock` is injectable (default time.time, the wall
clock shared with D).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from kv_transfer.signing import ClusterSecret, lease_key

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
    reader: str | None = None
    """The decode engine id the hand-off was issued for (None: any decode node of the cluster)."""
    claimed_by: str | None = None
    """The decode engine that redeemed it (the first claim)."""
    awaits_reader: bool = False
    """No claim wins until `bind` names the reader (see the module docstring)."""
    reads_done: bool = False
    """Set when the lease ends notified or aborted by its reader: no READ of it can still be running."""


def _done_mac(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest() if key else ""


def done_message(lease_id: str, consumer: str, total: int, key: bytes = b"") -> bytes:
    """One READ's completion, signed with the lease's key (`b""`: unsigned, for an insecure cluster)."""
    body = f"DONE:{lease_id}:{consumer}:{total}"
    return f"{body}:{_done_mac(key, body)}".encode()


class ClaimRefused(ValueError):
    """A claim the prefill node refuses; `status` is the HTTP status the side channel answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LeaseManager:
    """Leases of one prefill instance's exports (see the module docstring)."""

    def __init__(self, on_end: Callable[[Lease, str], None], ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time, secret: ClusterSecret | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self._on_end = on_end
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.late_notifications = 0
        self.rejected_notifications = 0
        """Notifications whose MAC did not verify (forged, or from a reader without the secret): they end nothing."""
        self._secret = secret

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._leases)

    def create(self, export: ExportKey, lease_id: str | None = None, reader: str | None = None,
               awaits_reader: bool = False) -> Lease:
        """Hold `export`'s rows for a reader (`reader`: the one decode engine that may claim them; `awaits_reader`:
        none is known yet, and none may claim before `bind` names it) until notified, aborted or expired."""
        if reader is not None and awaits_reader:
            raise ValueError("a lease that names its reader does not await one")
        lease = Lease(lease_id or uuid.uuid4().hex, export, self._clock() + self.ttl_s, reader=reader,
                      awaits_reader=awaits_reader)
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id} already exists")
            self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def claim(self, lease_id: str, reader: str) -> Lease:
        """Let `reader` redeem the lease, once (see the module docstring); ClaimRefused otherwise."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise ClaimRefused(404, "the lease has ended (expired, aborted or already read)")
            if lease.reader is None and lease.awaits_reader:
                raise ClaimRefused(403, "the hand-off is not bound to a reader yet")
            if lease.reader is not None and lease.reader != reader:
                raise ClaimRefused(403, "the hand-off was issued for another decode instance")
            if lease.claimed_by is not None:
                raise ClaimRefused(409, "the hand-off was already redeemed (a lease is read once)")
            lease.claimed_by = reader
            return lease

    def bind(self, lease_id: str, reader: str) -> Lease:
        """Name the one decode engine that may claim a lease that awaits its reader (the first bind wins; the same
        reader again is a no-op); ClaimRefused otherwise."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise ClaimRefused(404, "the lease has ended (expired, aborted or already read)")
            if lease.reader == reader:
                return lease
            if not lease.awaits_reader:
                raise ClaimRefused(409, "the lease was issued for its reader already")
            if lease.reader is not None or lease.claimed_by is not None:
                raise ClaimRefused(409, "the lease is bound to another reader")
            lease.reader = reader
            return lease

    def _end(self, lease_id: str, outcome: str, reads_done: bool = False) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            # under the lock that `claim` takes: a claim either came first (then READs may run) or is refused
            lease.reads_done = reads_done or lease.claimed_by is None
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

    def abort_claimed(self, lease_id: str, reader: str) -> bool:
        """The reader that claimed the lease will not read (none of its READs can still run): end it. Only that
        reader may (ClaimRefused 403 otherwise): another node's abort must not free rows a READ may be reading.
        False when the lease already ended."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            if lease.claimed_by != reader:
                raise ClaimRefused(403, "the lease was not claimed by this reader")
        return self._end(lease_id, "aborted", reads_done=True)

    def expire(self, now: float | None = None) -> list[str]:
        """End every lease past its deadline; the ids ended."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expiry <= now]
        return [lid for lid in due if self._end(lid, "expired")]

    def apply_message(self, msg: bytes) -> None:
        """Route one DONE notification; malformed or unauthenticated ones raise ValueError and end nothing."""
        text = msg.decode(errors="replace")
        body, _, mac = text.rpartition(":")
        kind, _, rest = body.partition(":")
        parts = rest.split(":")
        if kind != "DONE" or len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"malformed notification {text[:200]!r}")
        lease_id, consumer, total = parts
        if self._secret is not None:
            expected = _done_mac(lease_key(self._secret, lease_id), body)
            if not hmac.compare_digest(mac.encode(), expected.encode()):
                with self._lock:
                    self.rejected_notifications += 1
                raise ValueError("a DONE notification whose MAC does not verify (forged or unsigned)")
        self.notify_done(lease_id, consumer, int(total))
