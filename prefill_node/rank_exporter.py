"""The prefill node's side of a hand-off on one rank: each export's rows exposed to the KV transport for its
lease alone, and the readers' notifications turned into events.

`build_rank_exporter(config, rank, engine)` is the `WorkerConfig.rank_role` of a prefill node (prefill_node/app.py
names it): it builds the rank's NIXL agent (`kv_transfer.nixl_agent.NixlTransport`, agent `<engine id>-p<rank>`)
over the engine's row pool in per-lease exposure, unless the node runs without a transport, and hands it to a
`RankExporter` (kv_transfer/rank_exporter.py: each export's rows exposed for its lease alone, readers' DONE
messages drained). The worker (node/worker.py) reports the transport's endpoint at start (the side channel serves
it: the agent's connection, no memory). A prefill rank claims no command.
"""

from __future__ import annotations

from engine.api import RankEngine
from kv_transfer.rank_exporter import RankExporter
from node.rank import WorkerConfig

__all__ = ["RankExporter", "build_rank_exporter"]


def build_rank_exporter(config: WorkerConfig, rank: int, engine: RankEngine) -> RankExporter:
    """The prefill node's RankRole factory (runs in the rank process)."""
    from kv_transfer.nixl_agent import rank_agent

    transport = rank_agent(config, engine, "p", rank)
    return RankExporter(rank, transport)
