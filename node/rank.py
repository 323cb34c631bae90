"""What a rank process is built from and what it reports, and the two plug-ins of the shared rank worker.

- `WorkerConfig`: everything every rank needs to build its engine replica (picklable: it crosses the spawn); its
  `backend` names the first plug-in, the engine factory (engine/rank_engine.py `build_rank_engine`, returning an
  engine/api.py `RankEngine` that applies the rank commands itself).
- `RankInfo`: what a rank reports once ready.
- `RankRole`: the second, a node kind's side of the KV hand-off on one rank, which the worker (node/worker.py)
  calls around the engine: prefill_node/rank_exporter.py (register the pool, drain the readers' notifications) or
  decode_node/rank_importer.py (post, poll and cancel the READs of an import). The worker config names its
  factory (`rank_role`), which the node package chose, so node/ holds no prefill-only or decode-only code and
  knows the transport only as `kv_transfer.transport.KVTransport`.
A leaf of node/: it imports nothing of node/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.api import Command, EngineConfig, Event
from kv_transfer.transport import KVTransport, RankEndpoint
from kv_transfer.ucx_env import KVTransferSettings


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank needs to build its engine replica (picklable)."""

    engine: EngineConfig
    """The ranks' engine, as the node's settings hold it and completed with what the node decided (`tp_size`,
    `dcp_size`, `quarantine_s`); a rank hands it to the engine factory whole (engine/rank_engine.py places
    `device` "cuda" on the rank's own GPU)."""
    role: str
    """"prefill" or "decode": the node kind (labels; a prefill rank's warm-up captures no decode graphs); the
    hand-off code comes from `rank_role`."""
    engine_id: str
    token_shard_min_tokens: int = 1
    backend: str = "reference"
    """The ranks' engine factory: "reference" (engine/rank_engine.py `build_rank_engine`) or the "module:function"
    of another with its signature, returning an engine/api.py `RankEngine` (the node tests' toy engine)."""
    rank_role: str | None = None
    """"module:function" of the node kind's `RankRole` factory, called in the rank process as
    `factory(config, rank, engine)` (the rank's `RankEngine`); None: a rank with no hand-off (it refuses
    `ImportKV`)."""
    transport: bool = True
    """Register the pool with the KV transport (needed for P -> D transfer); the role builds the transport."""
    kv: KVTransferSettings = KVTransferSettings()
    """The node's KV transfer settings (the rank's NIXL agent, the import deadline)."""


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once ready."""

    rank: int
    num_rows: int
    block_size: int
    row_bytes: int
    subblock_tokens: int
    layout_fingerprint: str
    cache_dtype: str
    kda_groups: int
    endpoint: RankEndpoint | None = None
    """This rank's registered pool as readers address it (None without a transport)."""
    tcp_fallback: bool = False
    """UCX can only move this pool's bytes over TCP (kv_transfer.ucx_env.detect_tcp_fallback)."""
    kernels: str = "reference"
    """The kernel set this rank's engine runs ("reference" | "fast")."""


class RankRole(Protocol):
    """A node kind's side of the KV hand-off on one rank (see the module docstring)."""

    transport: KVTransport | None
    """The rank's transport with the pool registered (None: this node transfers nothing)."""

    def apply(self, cmd: Command) -> list[Event] | None:
        """The events of a command this role owns (`ImportKV` on a decode rank); None for the worker's own."""

    def abort(self, request_id: str) -> list[Event]:
        """An `Abort` reached the rank: end this role's part of the request (before the engine aborts it)."""

    def step(self, engine_events: list[Event]) -> list[Event]:
        """Called after every engine step with its events: what the role adds (rows exposed for the step's exports,
        what the transport brought in: notifications, finished READs)."""

    def close(self) -> None:
        """Release every transfer in flight and the transport."""
