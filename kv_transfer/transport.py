"""The transport interface the nodes program against (NIXL implements it in nixl_agent.py).

One transport object per GPU rank (per pool). Prefill side: `endpoint()` describes the registered pool
for the side channel; `notifications()` yields what readers sent (lease DONE / ABORT messages).
Decode side: `add_peer(endpoint)` once per remote rank, then per request `post_read(peer, ops, notif)` (ONE
read carrying one descriptor per op; ops come from kv_transfer.remap and are already merged), `poll` until
DONE or ERR (the notification to the peer is delivered while the reader polls), `result`, `release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, Sequence

from kv_transfer.remap import ReadOp


class TransferState(str, Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class TransferError(RuntimeError):
    """A read that failed (peer gone, backend error) or was refused before touching memory."""


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
    """Opaque per-read handle."""


class KVTransport(Protocol):
    """One rank's transfer agent. See the module docstring for the call order."""

    agent_name: str

    def endpoint(self, rank: int) -> RankEndpoint: ...

    def add_peer(self, peer: RankEndpoint) -> str: ...

    def post_read(self, peer: RankEndpoint, ops: Sequence[ReadOp], notif: bytes = b"") -> ReadHandle: ...

    def poll(self, handle: ReadHandle) -> TransferState: ...

    def result(self, handle: ReadHandle) -> ReadResult: ...

    def release(self, handle: ReadHandle) -> None: ...

    def send_notif(self, peer_agent: str, msg: bytes) -> None: ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
