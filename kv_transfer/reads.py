"""One request's READs on one decode rank, posted at once and polled without blocking, over a KVTransport.

`PendingReads(transport, d_rank, plan, endpoints, lease_id, timeout_s, notify_key)` posts one READ per source P
rank (each carries the lease's DONE notification, signed with `notify_key`, kv_transfer/lease.py, so P hears one
authenticated DONE per READ). Then:
- `poll()` never blocks: True once every READ is DONE; TransferError when one failed (ERR) or the request's own
  deadline (`timeout_s`, default settings.timeout_s, from the post) passed. A READ still running after
  `settings.repost_after_s` is cancelled and posted once more on a fresh endpoint (NixlTransport.repost). A READ
  the transport could not post yet (`PeerBusy`: its peer's entry is reloaded once the READs from that peer now
  running end, kv_transfer/nixl_agent.py) is posted by a later `poll()`, within the same deadline; none is posted
  after it.
- `close()` releases every handle, cancelling READs still running, and is called exactly once whatever the
  outcome. `uncancelled` is then True if NIXL refused to release a handle whose READ may still be running
  (a stalled READ dropped at a repost counts too): its late bytes may land in the destination rows, so the
  caller must keep those rows out of use for good.
`read_request(...)` is the blocking form (poll with a short spin, then back off; used by tests and benchmarks).
A decode rank (decode_node/rank_importer.py) polls between decode steps instead, so a stalled READ stalls only its
own request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kv_transfer.lease import done_message
from kv_transfer.remap import ReadPlan
from kv_transfer.transport import PeerBusy, RankEndpoint, ReadResult, TransferError, TransferState

log = logging.getLogger(__name__)

SPIN_S = 0.002
"""read_request polls back to back this long (a CMA or RDMA read of a few MB is done by then)..."""
POLL_SLEEP_S = 0.0005
"""...then sleeps this long between polls: on two cores a reader spinning for seconds takes a core from the
ranks it waits on."""


class PendingReads:
    """One request's READs on one D rank (see the module docstring)."""

    def __init__(self, transport: Any, d_rank: int, plan: ReadPlan, endpoints: dict[int, RankEndpoint],
                 lease_id: str, timeout_s: float | None = None, notify_key: bytes = b"") -> None:
        self.transport = transport
        self.timeout_s = timeout_s or transport.settings.timeout_s
        self.deadline = time.monotonic() + self.timeout_s
        self.handles: list[Any] = []
        self._reposted: set[int] = set()
        self._stuck: list[Any] = []  # handles NIXL would not release (their READ may still run)
        self._closed = False
        self.uncancelled = False
        total = len(plan.consumers())
        self._unposted: dict[int, tuple[RankEndpoint, Any, bytes]] = {}
        """Index in `handles` -> (peer, ops, notification) of a READ not posted yet (PeerBusy)."""
        try:
            for p_rank, ops in plan.by_source(d_rank).items():
                notif = done_message(lease_id, f"{d_rank}.{p_rank}", total, notify_key)
                self.handles.append(None)
                self._unposted[len(self.handles) - 1] = (endpoints[p_rank], ops, notif)
            self._post_waiting()
        except BaseException:
            self.close()
            raise

    def _post_waiting(self) -> bool:
        """Post the READs not posted yet; True when none is left waiting. None is posted once the request's deadline
        has passed: its import is failed by the next `poll()` anyway, and a READ posted then only moves bytes."""
        if self._unposted and time.monotonic() >= self.deadline:
            return False
        for i, (peer, ops, notif) in list(self._unposted.items()):
            try:
                self.handles[i] = self.transport.post_read(peer, ops, notif)
            except PeerBusy:
                continue
            del self._unposted[i]
        return not self._unposted

    def poll(self) -> bool:
        """True when every READ is DONE; raises TransferError on ERR or past the deadline. Never blocks."""
        now = time.monotonic()
        done = self._post_waiting()
        for i, handle in enumerate(self.handles):
            if handle is None:
                continue
            state = self.transport.poll(handle)
            if state is TransferState.ERR:
                raise TransferError(f"read from {handle.peer.agent_name} failed")
            if state is TransferState.PROC:
                done = False
                stalled_s = time.perf_counter() - handle.t_start
                if i not in self._reposted and stalled_s > self.transport.settings.repost_after_s \
                        and now < self.deadline:
                    log.warning("read from %s still running after %.1f s; posting it again on a fresh endpoint",
                                handle.peer.agent_name, stalled_s)
                    self._release(handle)
                    self._reposted.add(i)
                    try:
                        self.handles[i] = self.transport.repost(handle)
                    except PeerBusy:
                        self.handles[i] = None
                        self._unposted[i] = (handle.peer, handle.ops, handle.notif)
        if not done and now >= self.deadline:
            running = [h for h in self.handles if h is not None and h.state is TransferState.PROC]
            if not running:
                raise TransferError(f"{len(self._unposted)} read(s) could not be posted within {self.timeout_s:.3g} s "
                                    "(their peer's entry stayed busy, or the deadline passed before the post)")
            raise TransferError(f"{len(running)} read(s) from {running[0].peer.agent_name} "
                                f"({sum(h.nbytes for h in running)} B) still running after {self.timeout_s:.1f} s")
        return done

    def results(self) -> list[ReadResult]:
        return [self.transport.result(h) for h in self.handles]

    def _release(self, handle: Any) -> None:
        try:
            self.transport.release(handle)
        except Exception:  # noqa: BLE001 - NIXL keeps a handle it cannot cancel yet
            log.warning("could not release a read handle from %s", handle.peer.agent_name)
            self._stuck.append(handle)
            self.uncancelled = True

    def close(self) -> bool:
        """Release every handle (cancelling READs still running; stuck ones are tried again). True when no READ
        of this request can still write into the destination rows."""
        if not self._closed:
            self._closed = True
            stuck, self._stuck = self._stuck, []
            for handle in [h for h in self.handles if h is not None] + stuck:
                self._release(handle)
        return not self.uncancelled


def read_request(transport: Any, d_rank: int, plan: ReadPlan, endpoints: dict[int, RankEndpoint], lease_id: str,
                 timeout_s: float | None = None, notify_key: bytes = b"") -> list[ReadResult]:
    """Blocking form of PendingReads: post, poll to completion (spin SPIN_S, then every POLL_SLEEP_S), release.
    Raises TransferError on ERR or past the deadline."""
    reads = PendingReads(transport, d_rank, plan, endpoints, lease_id, timeout_s, notify_key)
    started = time.monotonic()
    try:
        while not reads.poll():
            if time.monotonic() - started > SPIN_S:
                time.sleep(POLL_SLEEP_S)
        return reads.results()
    finally:
        reads.close()
