"""The transport interface the nodes program against (NIXL implements it in nixl_agent.py).

node/ knows only this Protocol; the concrete transport is chosen by the node packages' rank roles
(prefill_node/rank_exporter.py, decode_node/rank_importer.py), which build it and hand it on.
One transport object per GPU rank (per pool). Prefill side: `endpoint()` describes the agent for the side
channel; with per-lease exposure the pool is not registered as a whole: `expose(rows)` registers one export's rows
and `unexpose` drops them at the lease's end, and only the decode node that claims the lease gets their metadata
(`RankEndpoint.sections`); `notifications()` yields what readers sent (lease DONE messages).
Decode side: `add_peer(endpoint)` once per remote rank, then per request `post_read(peer, ops, notif)` (ONE
read carrying one descriptor per op; ops come from kv_transfer.remap and are already merged), `poll` until
DONE or ERR (the notification to the peer is delivered while the reader polls), `result`, `release`; a READ
still running after `settings.repost_after_s` is cancelled and posted again with `repost` (kv_transfer/reads.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, Sequence

from kv_transfer.remap import ReadOp
from kv_transfer.ucx_env import KVTransferSettings


class TransferState(str, Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class TransferError(RuntimeError):
    """A read that failed (peer gone, backend error) or was refused before touching memory."""


class PeerBusy(TransferError):
    """A read that cannot be posted until the READs from its peer that are running now end (the peer's entry must
    be loaded afresh first: kv_transfer/nixl_agent.py); post it again later."""


@dataclass(frozen=True)
class RankEndpoint:
    """What a reader needs to address one rank's pool (served by the prefill node's side channel)."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    pool_bytes: int
    row_bytes: int
    num_rows: int
    mem_type: str = "DRAM"
    device_id: int = 0
    sections: bytes = b""
    """The partial metadata of the rows one lease exposes (a prefill rank in per-lease exposure: `agent_metadata`
    then carries its connection only, and a reader can address nothing but what `sections` names); empty: the
    agent metadata covers the whole pool."""


@dataclass(frozen=True)
class Exposure:
    """Rows a prefill rank registered for one export: the transport's registration handle and the metadata a
    reader needs to address exactly those rows."""

    handle: Any
    metadata: bytes
    num_regions: int


@dataclass(frozen=True)
class ReadResult:
    state: TransferState
    bytes: int
    descriptors: int
    """Descriptors posted (after kv_transfer's merge)."""
    backend_descriptors: int | None
    """Descriptors the backend ran after its own merge (NIXL telemetry), None if unknown."""
    post_s: float
    wall_s: float
    """Descriptor preparation + post + polling to DONE, as the caller saw it."""
    backend_xfer_s: float | None = None
    """The backend's own transfer time (NIXL telemetry xferDuration), None if unknown."""


class ReadHandle(Protocol):
    """One posted READ, as kv_transfer/reads.py follows it."""

    peer: RankEndpoint
    state: TransferState
    t_start: float
    """time.perf_counter() at the post."""

    @property
    def nbytes(self) -> int: ...


class KVTransport(Protocol):
    """One rank's transfer agent. See the module docstring for the call order."""

    agent_name: str
    settings: KVTransferSettings
    """Timeouts (`timeout_s`, `repost_after_s`) and the UCX configuration of this agent."""

    @property
    def tcp_fallback(self) -> bool:
        """The pool's bytes can only move over TCP (reported in the node metrics)."""

    def endpoint(self, rank: int) -> RankEndpoint: ...

    def expose(self, rows: Sequence[int]) -> Exposure:
        """Register `rows` of the pool (per-lease exposure) and describe them for a reader."""

    def unexpose(self, exposure: Exposure) -> None:
        """Deregister an exposure: no reader can address those rows through it any more."""

    def add_peer(self, peer: RankEndpoint) -> str: ...

    def post_read(self, peer: RankEndpoint, ops: Sequence[ReadOp], notif: bytes = b"") -> ReadHandle: ...

    def poll(self, handle: ReadHandle) -> TransferState: ...

    def repost(self, handle: ReadHandle) -> ReadHandle: ...

    def result(self, handle: ReadHandle) -> ReadResult: ...

    def release(self, handle: ReadHandle) -> None: ...

    def send_notif(self, peer_agent: str, msg: bytes) -> None: ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
