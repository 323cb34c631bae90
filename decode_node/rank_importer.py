"""The decode node's side of a hand-off on one rank: post, poll and cancel the READs of an import.

`build_rank_importer(config, rank, engine)` is the `WorkerConfig.rank_role` of a decode node (decode_node/app.py
names it): it builds the rank's NIXL agent (`kv_transfer.nixl_agent.NixlTransport`, agent `<engine id>-d<rank>`)
over the engine's row pool, unless the node runs without a transport, and hands it to a `RankImporter`, which
the shared worker (node/worker.py) calls:
- `apply(ImportKV)`: allocate the rows through the engine (`RankEngine.import_kv`: it may reuse the prompt's
  leading blocks from its prefix cache, `ImportRows.num_reused_tokens`, which are not read), plan the reads with kv_transfer.remap (P's layout rebuilt
  from the params and checked against its fingerprint: kv_transfer/importer.py) and post ONE READ per source P
  rank carrying one descriptor per merged row range, with the lease's DONE notification;
- `step()`, after every engine step: one non-blocking poll of every import in flight
  (kv_transfer.reads.PendingReads), so decode steps of other requests go on while a READ is in flight or stalled;
- `abort(request_id)`: cancel that request's READs;
- a stream it moves out on drain (`MoveOut`: the engine exports it, decode_node/moves.py) is exposed and its
  readers' DONE messages drained by the rank's `RankExporter` (kv_transfer/rank_exporter.py) over the same
  transport, as a prefill rank does; its `Release` or an `Abort` deregisters the rows.
Invariant: each rank answers exactly one `ImportOutcome` per `ImportKV` it applied - when its READs are all DONE,
when one fails or the import's deadline (`config.kv.timeout_s`) passes, at once if it cannot post, or when an
`Abort` cancels it - and it has released every READ handle by then. `uncancelled` on the outcome says NIXL
refused to cancel one: the driver then sends `HoldRows` so every rank keeps those rows out for good. The driver
merges the ranks' outcomes and only then lets the request decode (decode_node/importer.py sends `StartDecode`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from engine.api import Command, Event, ImportKV, ImportOutcome, RankEngine
from kv_transfer.importer import post_import
from kv_transfer.rank_exporter import RankExporter
from kv_transfer.reads import PendingReads
from kv_transfer.transport import KVTransport
from node.rank import WorkerConfig


@dataclass
class _Import:
    """An import in flight on this rank."""

    request_id: str
    reads: PendingReads
    started: float


class RankImporter:
    """One decode rank's imports in flight (see the module docstring)."""

    def __init__(self, rank: int, engine: RankEngine, transport: KVTransport | None, timeout_s: float) -> None:
        self.rank = rank
        self.engine = engine
        self.transport = transport
        self.timeout_s = timeout_s
        """An import's deadline from its post (the node's `kv.timeout_s`)."""
        self._imports: dict[str, _Import] = {}
        self.exports = RankExporter(rank, transport)
        """The streams this rank moves out (exposed for their lease alone)."""

    def _error(self, request_id: str, exc: BaseException | str, uncancelled: bool = False) -> ImportOutcome:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        return ImportOutcome(request_id=request_id, error=f"rank {self.rank}: {reason}", uncancelled=uncancelled)

    def apply(self, cmd: Command) -> list[Event] | None:
        return self._post(cmd) if isinstance(cmd, ImportKV) else self.exports.apply(cmd)

    def _post(self, cmd: ImportKV) -> list[Event]:
        """Allocate, plan and post the READs (`cmd.params` were checked by the decode node; `cmd.peer` is the
        prefill node's side-channel InstanceMetadata); the outcome comes from a later `step`."""
        from engine.cache import OutOfRows

        started = time.perf_counter()
        try:
            if self.transport is None:
                raise ValueError("this node runs without a KV transport")
            rows = self.engine.import_kv(cmd)
            reads = post_import(self.transport, self.engine.model_config, self.engine.layout, self.rank, cmd.params,
                                cmd.peer, list(rows.attn_row_ids), list(rows.kda_row_ids), timeout_s=self.timeout_s,
                                skip_tokens=rows.num_reused_tokens, notify_key=cmd.notify_key)
        except OutOfRows as exc:  # import_kv raises before allocating: nothing to undo, the node may retry
            return [dataclasses.replace(self._error(cmd.request_id, exc), short_of_rows=True)]
        except Exception as exc:  # noqa: BLE001 - any failure becomes this rank's import error
            return [self._error(cmd.request_id, exc)]
        self._imports[cmd.request_id] = _Import(cmd.request_id, reads, started)
        return []

    def step(self, engine_events: list[Event]) -> list[Event]:
        """One non-blocking poll of every import in flight; the outcomes of those that ended."""
        events: list[Event] = []
        for imp in list(self._imports.values()):
            try:
                if not imp.reads.poll():
                    continue
                results = imp.reads.results()
            except Exception as exc:  # noqa: BLE001 - a failed READ, a deadline, a NIXL error: this import's error
                del self._imports[imp.request_id]
                events.append(self._error(imp.request_id, exc, uncancelled=not imp.reads.close()))
                continue
            del self._imports[imp.request_id]
            clean = imp.reads.close()
            events.append(ImportOutcome(request_id=imp.request_id, num_bytes=sum(r.bytes for r in results),
                                        seconds=time.perf_counter() - imp.started,
                                        num_descriptors=sum(r.descriptors for r in results),
                                        post_s=tuple(r.post_s for r in results), uncancelled=not clean))
        return events + self.exports.step(engine_events)

    def abort(self, request_id: str) -> list[Event]:
        """An abort reached an import in flight: cancel its READs; its one outcome says whether they were."""
        self.exports.abort(request_id)
        imp = self._imports.pop(request_id, None)
        if imp is None:
            return []
        return [self._error(request_id, "aborted", uncancelled=not imp.reads.close())]

    def close(self) -> None:
        for imp in self._imports.values():
            imp.reads.close()
        self._imports.clear()
        self.exports.close()  # its exposures, then the transport


def build_rank_importer(config: WorkerConfig, rank: int, engine: RankEngine) -> RankImporter:
    """The decode node's RankRole factory (runs in the rank process)."""
    from kv_transfer.nixl_agent import rank_agent

    transport = rank_agent(config, engine, "d", rank)
    return RankImporter(rank, engine, transport, config.kv.timeout_s)
