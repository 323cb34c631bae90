"""The prefill node's KV side channel: agent metadata and lease control over HTTP.

Prefill node: `app.include_router(side_channel_router(get_metadata, leases))` mounts
  GET  /kv/metadata                    -> InstanceMetadata (engine id, layout facts, one entry per rank with
                                          its NIXL agent metadata, pool address and size)
  POST /kv/leases/{lease_id}/abort     -> LeaseStatus | 404 OpenAI error JSON if it already ended
`get_metadata` is a callable so the node can build it lazily once its ranks registered their pools; `leases` is
anything with `abort(lease_id) -> bool` (the node's export table: the abort goes through its lease).
Decode node: `fetch_metadata(host, port)` (httpx, bounded timeout); it posts the abort when it will not read.
"""

from __future__ import annotations

import base64
from typing import Callable, Protocol

import httpx
from fastapi import APIRouter
from pydantic import BaseModel

from kv_transfer.transport import RankEndpoint
from serving.errors import APIError


class RankMetadata(BaseModel):
    rank: int
    agent_name: str
    agent_metadata_b64: str
    base_addr: int
    pool_bytes: int
    row_bytes: int
    num_rows: int
    mem_type: str = "DRAM"
    device_id: int = 0

    @classmethod
    def from_endpoint(cls, ep: RankEndpoint) -> "RankMetadata":
        return cls(rank=ep.rank, agent_name=ep.agent_name, agent_metadata_b64=base64.b64encode(ep.agent_metadata).decode(),
                   base_addr=ep.base_addr, pool_bytes=ep.pool_bytes, row_bytes=ep.row_bytes, num_rows=ep.num_rows,
                   mem_type=ep.mem_type, device_id=ep.device_id)

    def to_endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.rank, self.agent_name, base64.b64decode(self.agent_metadata_b64), self.base_addr,
                            self.pool_bytes, self.row_bytes, self.num_rows, self.mem_type, self.device_id)


class InstanceMetadata(BaseModel):
    """Everything a decode instance needs to read from this prefill instance."""

    engine_id: str
    model: str
    layout_fingerprint: str
    tp_size: int
    dcp_size: int = 1
    block_size: int
    subblock_tokens: int
    row_bytes: int
    num_rows: int
    kda_groups: int
    ranks: list[RankMetadata]

    def endpoints(self) -> dict[int, RankEndpoint]:
        return {r.rank: r.to_endpoint() for r in self.ranks}


class LeaseStatus(BaseModel):
    lease_id: str
    alive: bool


class LeaseAborter(Protocol):
    def abort(self, lease_id: str) -> bool: ...


def side_channel_router(get_metadata: Callable[[], InstanceMetadata], leases: LeaseAborter | None = None) -> APIRouter:
    """The /kv routes (see the module docstring)."""
    router = APIRouter(prefix="/kv")

    @router.get("/metadata", response_model=InstanceMetadata)
    def metadata() -> InstanceMetadata:
        return get_metadata()

    @router.post("/leases/{lease_id}/abort", response_model=LeaseStatus)
    def abort(lease_id: str) -> LeaseStatus:
        if leases is None:
            raise APIError(404, "this node exports no leases")
        if not leases.abort(lease_id):
            raise APIError(404, f"lease {lease_id} has ended (expired, aborted or already read)", param="lease_id")
        return LeaseStatus(lease_id=lease_id, alive=False)

    return router


def fetch_metadata(host: str, port: int, timeout_s: float = 5.0) -> InstanceMetadata:
    """GET the prefill instance's metadata (raises httpx errors on failure)."""
    resp = httpx.get(f"http://{host}:{port}/kv/metadata", timeout=timeout_s)
    resp.raise_for_status()
    return InstanceMetadata.model_validate(resp.json())

