"""The prefill node's side of a hand-off on one rank: the pool registered with the KV transport, and the readers'
notifications turned into events.

`build_rank_exporter(config, rank, engine)` is the `WorkerConfig.rank_role` of a prefill node (prefill_node/app.py
names it): it builds the rank's NIXL agent (`kv_transfer.nixl_agent.NixlTransport`, agent `<engine id>-p<rank>`)
over the engine's row pool, unless the node runs without a transport, and hands it to a `RankExporter`. The
worker (node/worker.py) reports the transport's endpoint at start (the side channel serves it); after every
engine step `RankExporter.step` drains what readers sent (lease DONE / ABORT messages) into `TransportNotice`s,
which the node's exporter (prefill_node/exporter.py) applies to its leases. A prefill rank claims no command.
"""

from __future__ import annotations

from engine.api import Command, Event, RankEngine, TransportNotice
from kv_transfer.transport import KVTransport
from node.rank import WorkerConfig


class RankExporter:
    """One prefill rank's transport and its notifications (see the module docstring)."""

    def __init__(self, rank: int, transport: KVTransport | None) -> None:
        self.rank = rank
        self.transport = transport

    def apply(self, cmd: Command) -> list[Event] | None:
        return None

    def abort(self, request_id: str) -> list[Event]:
        return []

    def step(self) -> list[Event]:
        if self.transport is None:
            return []
        return [TransportNotice(rank=self.rank, sender=sender, message=message)
                for sender, message in self.transport.notifications()]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def build_rank_exporter(config: WorkerConfig, rank: int, engine: RankEngine) -> RankExporter:
    """The prefill node's RankRole factory (runs in the rank process)."""
    from kv_transfer.nixl_agent import rank_agent

    transport = rank_agent(config, engine, "p", rank)
    return RankExporter(rank, transport)
