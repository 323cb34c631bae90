"""The export half of a hand-off on one rank: each export's rows exposed to the KV transport for its lease alone,
and the readers' notifications turned into events. A prefill rank's role (prefill_node/rank_exporter.py) is one;
a decode rank's role (decode_node/rank_importer.py) holds one for the streams it moves out on drain.

After every engine step `RankExporter.step` sees the step's events: for each `ExportedRows` it registers exactly
that export's rows with the transport and answers a `RowsExposed` with the metadata that addresses them (the
node's exporter, kv_transfer/exporter.py, hands it to the decode node that claims the lease); it then drains what
readers sent (lease DONE messages) into `TransportNotice`s. The export's `Release` (its lease ended) or an `Abort`
of its request deregisters the rows, so no reader can address them from then on. It claims no command.
"""

from __future__ import annotations

import logging

from engine.api import Command, Event, ExportedRows, Release, RowsExposed, TransportNotice
from kv_transfer.transport import Exposure, KVTransport

log = logging.getLogger(__name__)


class RankExporter:
    """One prefill rank's transport, its exposed exports and its notifications (see the module docstring)."""

    def __init__(self, rank: int, transport: KVTransport | None) -> None:
        self.rank = rank
        self.transport = transport
        self._exposed: dict[tuple[str, int], Exposure] = {}
        """(request id, export generation) -> the registration of that export's rows."""

    @property
    def num_exposed(self) -> int:
        return len(self._exposed)

    def apply(self, cmd: Command) -> list[Event] | None:
        if isinstance(cmd, Release):  # the engine frees (or quarantines) the rows: first they stop being readable
            self._unexpose((cmd.request_id, cmd.generation))
        return None

    def abort(self, request_id: str) -> list[Event]:
        for key in [k for k in self._exposed if k[0] == request_id]:
            self._unexpose(key)
        return []

    def step(self, engine_events: list[Event]) -> list[Event]:
        if self.transport is None:
            return []
        events: list[Event] = [self._expose(e) for e in engine_events if isinstance(e, ExportedRows)]
        return events + [TransportNotice(rank=self.rank, sender=sender, message=message)
                         for sender, message in self.transport.notifications()]

    def _expose(self, exported: ExportedRows) -> RowsExposed:
        key = (exported.request_id, exported.generation)
        try:
            exposure = self.transport.expose(list(exported.attn_row_ids) + list(exported.kda_row_ids))
        except Exception as exc:  # noqa: BLE001 - the export stays unreadable; the node refuses its claim
            log.warning("rank %d could not expose export %s: %s", self.rank, key, exc)
            return RowsExposed(request_id=key[0], generation=key[1], rank=self.rank, error=str(exc))
        self._unexpose(key)  # a repeated export replaces its earlier registration
        self._exposed[key] = exposure
        return RowsExposed(request_id=key[0], generation=key[1], rank=self.rank, metadata=exposure.metadata)

    def _unexpose(self, key: tuple[str, int]) -> None:
        exposure = self._exposed.pop(key, None)
        if exposure is not None and self.transport is not None:
            self.transport.unexpose(exposure)

    def close(self) -> None:
        for key in list(self._exposed):
            self._unexpose(key)
        if self.transport is not None:
            self.transport.close()
