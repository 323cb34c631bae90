"""Exported rows of the prefill node and the leases (kv_transfer.lease) that bound how long they wait.

`ExportTable.grant()` turns an engine export into the wire params and starts a lease over the request's
rows; the rows are freed (`Release` to every rank) exactly once, by whichever comes first: the readers'
DONE notifications (one per READ), an abort (by request id, or a reader's ABORT / HTTP release), or lease
expiry (`sweep()`, run periodically). Heartbeats push the expiry. Lease outcomes feed the node metrics.
Thread-safe: notifications arrive on the executor's driver thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kv_transfer.lease import OUTCOMES, LeaseManager
from kv_transfer.params import KVTransferParams
from node.executor import Executor
from node.metrics import NodeMetrics
from node.protocol import ExportedRows, Release, TransportNotice


@dataclass(frozen=True)
class ExportIdentity:
    """What the params say about this instance (constant for its lifetime)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    block_size: int
    subblock_tokens: int
    layout_fingerprint: str


class ExportTable:
    """Leases on exported rows, keyed by request id for aborts."""

    def __init__(self, identity: ExportIdentity, executor: Executor, metrics: NodeMetrics,
                 lease_seconds: float) -> None:
        self.identity = identity
        self.executor = executor
        self.metrics = metrics
        self.leases = LeaseManager(self._free_rows, ttl_s=lease_seconds)
        self._lease_of: dict[str, str] = {}
        self._lock = threading.Lock()
        self._counted = {outcome: 0 for outcome in OUTCOMES}

    def _free_rows(self, rows: tuple[int, ...]) -> None:
        if self.executor.healthy:
            self.executor.submit(Release(row_ids=tuple(rows)))

    def _sync_metrics(self) -> None:
        with self._lock:
            for outcome in OUTCOMES:
                delta = self.leases.outcomes[outcome] - self._counted[outcome]
                if delta > 0:
                    self.metrics.lease_outcomes.labels(outcome=outcome).inc(delta)
                    if outcome == "expired":
                        self.metrics.expired_reqs.inc(delta)
                    self._counted[outcome] += delta
            self.metrics.leases_outstanding.set(self.leases.outstanding)

    def grant(self, request_id: str, exported: ExportedRows) -> KVTransferParams:
        rows = tuple(exported.attn_row_ids) + tuple(exported.kda_row_ids)
        lease = self.leases.create(rows)
        with self._lock:
            self._lease_of[request_id] = lease.lease_id
        self.metrics.rows_exported.inc(len(rows))
        self._sync_metrics()
        ident = self.identity
        return KVTransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=ident.engine_id,
            remote_request_id=request_id, remote_block_ids=[list(exported.attn_row_ids)],
            remote_host=ident.host, remote_port=ident.port, tp_size=ident.tp_size, dcp_size=1, pp_size=1,
            remote_num_tokens=exported.num_tokens, remote_blocks_expiry_time=lease.expiry, transfer_mode="pull",
            remote_prefill_cached_tokens=exported.num_cached_tokens, block_size=ident.block_size,
            subblock_tokens=ident.subblock_tokens, layout_fingerprint=ident.layout_fingerprint,
            remote_kda_block_ids=list(exported.kda_row_ids), first_token_id=exported.first_token,
            lease_id=lease.lease_id, lease_expiry=lease.expiry,
        )

    def on_notice(self, notice: TransportNotice) -> None:
        """A reader's DONE / HB / ABORT message (called on the driver thread)."""
        try:
            self.leases.apply_message(notice.message)
        except ValueError:
            pass  # a malformed message frees nothing; the lease still expires
        self._sync_metrics()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            lease_id = self._lease_of.pop(request_id, None)
        ended = lease_id is not None and self.leases.abort(lease_id)
        self._sync_metrics()
        return ended

    def release(self, lease_id: str) -> bool:
        ended = self.leases.abort(lease_id)
        self._sync_metrics()
        return ended

    def extend(self, lease_id: str) -> float | None:
        return self.leases.heartbeat(lease_id)

    def sweep(self) -> list[str]:
        expired = self.leases.expire()
        with self._lock:
            live = {lid for lid in self._lease_of.values() if self.leases.get(lid) is not None}
            self._lease_of = {rid: lid for rid, lid in self._lease_of.items() if lid in live}
        self._sync_metrics()
        return expired

    def holds(self, request_id: str) -> bool:
        """True while a lease may still keep this request id's rows in the engine."""
        with self._lock:
            lease_id = self._lease_of.get(request_id)
        return lease_id is not None and self.leases.get(lease_id) is not None

    @property
    def num_outstanding(self) -> int:
        return self.leases.outstanding
