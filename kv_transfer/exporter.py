"""The export half of a hand-off, node side: leases on exported rows, shared by the prefill node (each export of a
prompt) and the decode node (a running request moved to another decode instance on drain, docs/ARCHITECTURE.md).
The prefill node exports a prompt's rows (node/export.py `serve_export`); a draining decode node exports
a running stream's rows (decode_node/moves.py). Either way:
Lease: `Exporter.grant()` turns an engine export (`ExportedRows`: request id, generation, rows) into the wire params
and starts a lease naming that export. The lease ends exactly once, by whichever comes first: the readers' DONE
notifications (one per READ, each signed with the lease's key: kv_transfer/lease.py), an abort (`abort(request_id)`
from the node's /abort_requests, or `abort_lease` from a reader's signed side-channel abort), or expiry (`sweep()`, run periodically). Its end sends
`Release(request_id, generation, reads_done)` to every rank: the engine frees exactly that export (a release
naming an export that is no longer live frees nothing), at once when no READ can still run (notified, or the
reader aborted), else into quarantine for the read timeout (a READ posted before the end may still target them).
An abort that lands before the grant (between the engine's export step and `grant`) is remembered: the ranks
end the export on their own `Abort`, and `grant` refuses it (APIError 499), so no lease and no params ever
point at rows an abort already gave back. Since a reader reads only after its claim won, an export aborted before
anyone claimed its lease (or before it had one) gives its rows back at once (`abort` answers `reads_done`, which
the ranks' `Abort` carries); only a claimed one's go into quarantine. Lease outcomes feed the node metrics.
Exposure: each rank's `RankExporter` (kv_transfer/rank_exporter.py) registers an export's rows, and only those,
with its transport and reports the metadata that addresses them (`RowsExposed`), before the export reaches
`grant`; `claim(lease_id, reader)` hands that metadata, per rank, to the one decode node whose claim wins
(kv_transfer/lease.py), and the lease's end deregisters the rows on every rank (its `Release`).
Notifications: each rank's `RankExporter` drains its transport after every step; the executor hands the
`TransportNotice`s (and `RowsExposed`) to `on_notice`, which the exporter subscribes when it is built.
Thread-safe: notifications arrive on the executor's driver thread, the rest on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.api import Command, ExportedRows, HandOffAbort, Release, RowsExposed, TransportNotice
from kv_transfer.lease import OUTCOMES, ExportKey, Lease, LeaseManager
from kv_transfer.params import KVTransferParams
from kv_transfer.signing import ClusterSecret, prompt_digest, sign
from serving.errors import APIError


class CommandSink(Protocol):
    """What the exporter needs of the node's executor (node/executor.py `Executor`)."""

    @property
    def healthy(self) -> bool: ...

    def submit(self, cmd: Command) -> None: ...

    def on_notice(self, handler: Callable[[Any], None]) -> None: ...


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


class Exporter:
    """Leases on exported rows, keyed by request id for aborts (see the module docstring)."""

    def __init__(self, identity: ExportIdentity, executor: CommandSink, metrics: Any,
                 lease_seconds: float, secret: ClusterSecret | None = None, require_reader: bool = False) -> None:
        self.identity = identity
        self.require_reader = require_reader
        """Export requests must name their reader (node setting `require_reader`: node/export.py refuses the rest)."""
        self.secret = secret
        """Signs every granted hand-off (kv_transfer/signing.py); None only on an insecure node."""
        self.executor = executor
        self.metrics = metrics
        self.leases = LeaseManager(self._lease_ended, ttl_s=lease_seconds, secret=secret)
        self._lease_of: dict[str, str] = {}
        self._exporting: dict[str, bool] = {}
        """Exports in flight (`begin` .. `forget`) -> aborted before their grant."""
        self._exposed: dict[ExportKey, dict[int, bytes]] = {}
        """Export -> per rank, the metadata that addresses its rows (RowsExposed), until its lease ends."""
        self._lock = threading.Lock()
        self._counted = {outcome: 0 for outcome in OUTCOMES}
        executor.on_notice(self.on_notice)

    def _lease_ended(self, lease: Lease, outcome: str) -> None:
        key = lease.export
        with self._lock:  # the Release is queued before the lease stops naming the request (`abort` relies on it)
            try:
                if self.executor.healthy:
                    self.executor.submit(Release(request_id=key.request_id, generation=key.generation,
                                                 reads_done=lease.reads_done))
            finally:  # a dead executor (ExecutorDead) frees nothing, but the lease is over all the same
                if self._lease_of.get(key.request_id) == lease.lease_id:
                    del self._lease_of[key.request_id]
                self._exposed.pop(key, None)

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

    def grant(self, request_id: str, exported: ExportedRows, prompt_token_ids: list[int],
              reader: str | None = None, transfer_mode: str = "pull", awaits_reader: bool = False) -> KVTransferParams:
        """Lease the export and answer its params, bound to the prompt and to `reader` (the decode engine the
        router named, which alone may claim it; None: the first decode node that claims it, or with
        `awaits_reader` the one a later `bind` names) and signed with the cluster secret; APIError 499 if the
        request was aborted before this. `transfer_mode`: "pull" (a prefill node's export) or "move" (a decode
        node's running stream, decode_node/moves.py)."""
        with self._lock:  # the check and the lease as one step: an abort comes before both or after both
            aborted = self._exporting.get(request_id, False)
            if not aborted:
                lease = self.leases.create(ExportKey(request_id, exported.generation), reader=reader,
                                           awaits_reader=awaits_reader)
                self._lease_of[request_id] = lease.lease_id
        if aborted:
            if self.executor.healthy:  # the ranks' Abort ends it too; whichever comes second frees nothing
                # no lease, so no reader: the rows are free at once
                self.executor.submit(Release(request_id=request_id, generation=exported.generation, reads_done=True))
            raise APIError(499, f"request {request_id} was aborted before its rows were leased")
        self.metrics.rows_exported.inc(len(exported.attn_row_ids) + len(exported.kda_row_ids))
        self.metrics.handoffs_issued.labels(reader="any" if reader is None and not awaits_reader else "bound").inc()
        self._sync_metrics()
        ident = self.identity
        params = KVTransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=ident.engine_id,
            remote_request_id=request_id, remote_block_ids=[list(exported.attn_row_ids)],
            remote_host=ident.host, remote_port=ident.port, tp_size=ident.tp_size, dcp_size=1, pp_size=1,
            remote_num_tokens=exported.num_tokens, remote_blocks_expiry_time=lease.expiry, transfer_mode=transfer_mode,
            remote_prefill_cached_tokens=exported.num_cached_tokens, block_size=ident.block_size,
            subblock_tokens=ident.subblock_tokens, layout_fingerprint=ident.layout_fingerprint,
            remote_kda_block_ids=list(exported.kda_row_ids), **KVTransferParams.first_token_fields(exported.first),
            lease_id=lease.lease_id, lease_expiry=lease.expiry, prompt_digest=prompt_digest(prompt_token_ids),
            decode_engine_id=reader,
        )
        return params if self.secret is None else sign(params, self.secret)

    def on_notice(self, notice: TransportNotice | RowsExposed) -> None:
        """A reader's DONE message, or a rank's exposure of an export (called on the driver thread)."""
        if isinstance(notice, RowsExposed):
            if notice.error is None:
                with self._lock:
                    self._exposed.setdefault(ExportKey(notice.request_id, notice.generation), {})[notice.rank] = \
                        notice.metadata
            return
        try:
            self.leases.apply_message(notice.message)
        except ValueError:
            pass  # a malformed or forged message frees nothing; the lease still ends by its reader or expiry
        self._sync_metrics()

    def abort(self, request_id: str, in_flight: Iterable[str] = ()) -> HandOffAbort:
        """End the leases of `request_id` and of `in_flight` (its ids still running here, which the caller then
        aborts on the ranks); every export among `in_flight` is refused a lease from now on. `reads_done` unless
        one of those leases had been claimed: a reader only reads after its claim won, and once the lease ended
        (or an export is refused its lease) no claim can win, so no READ can target an unclaimed export's rows."""
        ids = {request_id, *in_flight}
        with self._lock:
            lease_ids = [self._lease_of[rid] for rid in ids if rid in self._lease_of]
            for rid in in_flight:
                if rid in self._exporting:
                    self._exporting[rid] = True
        ended, reads_done = False, True
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and self.leases.abort(lease_id):
                ended, reads_done = True, reads_done and lease.reads_done  # final once the lease ended
            else:  # it ended meanwhile, its Release maybe not queued yet: the ranks' Abort must not free the rows
                reads_done = False
        self._sync_metrics()
        return HandOffAbort(ended=ended, reads_done=reads_done)

    def claim(self, lease_id: str, reader: str) -> dict[int, bytes]:
        """Let `reader` redeem the lease (the first claim wins: kv_transfer/lease.py `claim`, ClaimRefused
        otherwise); per rank, the metadata that addresses the lease's rows and nothing else."""
        lease = self.leases.claim(lease_id, reader)
        with self._lock:
            return dict(self._exposed.get(lease.export, {}))

    def bind(self, lease_id: str, reader: str) -> None:
        """Name the reader of a lease that awaits one (kv_transfer/lease.py `bind`; ClaimRefused otherwise)."""
        self.leases.bind(lease_id, reader)

    def abort_lease(self, lease_id: str, reader: str) -> bool:
        """The reader that claimed the lease will not read, and none of its READs can still run (the side channel's
        abort route); ClaimRefused when another reader claimed it."""
        try:
            return self.leases.abort_claimed(lease_id, reader)
        finally:
            self._sync_metrics()

    def begin(self, request_id: str) -> None:
        """An export of `request_id` starts (before its Submit): an abort from now on reaches `grant`."""
        with self._lock:
            self._exporting[request_id] = False

    def forget(self, request_id: str) -> None:
        """The export path of `request_id` is over (granted or failed; an ungranted export's exposure is dropped:
        its ranks deregister the rows on their Abort)."""
        with self._lock:
            self._exporting.pop(request_id, None)
            if request_id not in self._lease_of:
                for key in [k for k in self._exposed if k.request_id == request_id]:
                    del self._exposed[key]

    def sweep(self) -> list[str]:
        """Expire leases past their deadline."""
        expired = self.leases.expire()
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
