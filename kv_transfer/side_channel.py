"""The prefill node's KV side channel: agent metadata and lease control over HTTP.

Prefill node: `app.include_router(side_channel_router(get_metadata, leases))` mounts
  GET  /kv/metadata                    -> InstanceMetadata (engine id, layout facts, one entry per rank with
                                          its NIXL agent metadata, pool address and size; a prefill node's
                                          agents expose rows per lease, so this metadata addresses no row)
  POST /kv/leases/{lease_id}/claim     -> LeaseGrant (body `LeaseClaim`: the reader's engine id): per rank, the
                                          metadata that addresses the lease's rows alone | 404 ended, 403 issued
                                          for another reader, 409 already redeemed (kv_transfer/lease.py)
  POST /kv/leases/{lease_id}/bind      -> LeaseStatus (body `LeaseClaim`: the reader the router chose) for a lease
                                          that awaits its reader (a stream moved out on drain) | 404 ended, 409
                                          bound to another reader or claimed (kv_transfer/lease.py `bind`)
  POST /kv/leases/{lease_id}/abort     -> LeaseStatus (body `LeaseClaim`: the reader that claimed it) | 404 OpenAI
                                          error JSON if it already ended, 403 claimed by another reader
`get_metadata` is a callable so the node can build it lazily once its ranks registered their pools; `leases` is
anything with `abort(lease_id, reader) -> bool`, `claim(lease_id, reader)` and `bind(lease_id, reader)` (the node's
export table: each goes through its lease). Every route
answers only requests signed with the cluster secret (`guard`, kv_transfer/cluster_auth.py; 401 otherwise): the
metadata opens the pools to NIXL reads, an abort ends a reader's lease.
Decode node: `fetch_metadata(host, port, auth=ClusterAuth(secret))` (httpx, bounded timeout); it claims each lease
before it reads, and posts the abort when it will not read, both signed alike.
"""

from __future__ import annotations

import base64
from typing import Callable, Protocol

import httpx
from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from kv_transfer.cluster_auth import ClusterAuth, ControlGuard
from kv_transfer.lease import ClaimRefused
from kv_transfer.signing import ENGINE_ID_PATTERN
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
    sections_b64: str = ""
    """One lease's sections (kv_transfer/transport.py `RankEndpoint.sections`): set by the decode node from the
    lease's grant, never served by GET /kv/metadata."""

    @classmethod
    def from_endpoint(cls, ep: RankEndpoint) -> "RankMetadata":
        return cls(rank=ep.rank, agent_name=ep.agent_name, agent_metadata_b64=base64.b64encode(ep.agent_metadata).decode(),
                   base_addr=ep.base_addr, pool_bytes=ep.pool_bytes, row_bytes=ep.row_bytes, num_rows=ep.num_rows,
                   mem_type=ep.mem_type, device_id=ep.device_id)

    def to_endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.rank, self.agent_name, base64.b64decode(self.agent_metadata_b64), self.base_addr,
                            self.pool_bytes, self.row_bytes, self.num_rows, self.mem_type, self.device_id,
                            base64.b64decode(self.sections_b64))


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

    @classmethod
    def from_ranks(cls, engine_id: str, model: str, ranks: list, tp_size: int, dcp_size: int = 1) -> "InstanceMetadata":
        """A node's metadata from its ranks' startup reports (node.rank.RankInfo: rank 0's layout, each endpoint)."""
        head = ranks[0]
        return cls(engine_id=engine_id, model=model, layout_fingerprint=head.layout_fingerprint, tp_size=tp_size,
                   dcp_size=dcp_size, block_size=head.block_size, subblock_tokens=head.subblock_tokens,
                   row_bytes=head.row_bytes, num_rows=head.num_rows, kda_groups=head.kda_groups,
                   ranks=[RankMetadata.from_endpoint(info.endpoint) for info in ranks if info.endpoint is not None])

    def endpoints(self) -> dict[int, RankEndpoint]:
        return {r.rank: r.to_endpoint() for r in self.ranks}

    def for_lease(self, grant: "LeaseGrant") -> "InstanceMetadata":
        """This instance as one lease's reader addresses it: each rank with the lease's sections."""
        sections = {s.rank: s.sections_b64 for s in grant.ranks}
        ranks = [r.model_copy(update={"sections_b64": sections.get(r.rank, "")}) for r in self.ranks]
        return self.model_copy(update={"ranks": ranks})


class LeaseStatus(BaseModel):
    lease_id: str
    alive: bool


class RankSections(BaseModel):
    rank: int
    sections_b64: str


class LeaseGrant(BaseModel):
    """A claim that won: per rank, the metadata that addresses the lease's rows (none: the ranks expose the whole
    pool, or run without a transport)."""

    lease_id: str
    ranks: list[RankSections] = []


class LeaseClaim(BaseModel):
    """A decode node redeems a lease: its own engine id."""

    reader: str = Field(pattern=ENGINE_ID_PATTERN.pattern, max_length=128)


class LeaseControl(Protocol):
    def abort(self, lease_id: str, reader: str) -> bool:
        """False when the lease already ended; ClaimRefused when `reader` did not claim it."""

    def claim(self, lease_id: str, reader: str) -> dict[int, bytes]:
        """Per rank, the lease's sections; raises ClaimRefused (kv_transfer/lease.py) unless `reader` redeems the
        lease now."""

    def bind(self, lease_id: str, reader: str) -> None:
        """Name the reader of a lease that awaits one; raises ClaimRefused (kv_transfer/lease.py) otherwise."""


def side_channel_router(get_metadata: Callable[[], InstanceMetadata], guard: ControlGuard,
                        leases: LeaseControl | None = None) -> APIRouter:
    """The /kv routes (see the module docstring), each behind `guard`."""
    router = APIRouter(prefix="/kv", dependencies=[Depends(guard.check)])

    @router.get("/metadata", response_model=InstanceMetadata)
    def metadata() -> InstanceMetadata:
        return get_metadata()

    @router.post("/leases/{lease_id}/claim", response_model=LeaseGrant)
    def claim(lease_id: str, body: LeaseClaim) -> LeaseGrant:
        if leases is None:
            raise APIError(404, "this node exports no leases")
        try:
            sections = leases.claim(lease_id, body.reader)
        except ClaimRefused as exc:
            raise APIError(exc.status, str(exc), param="lease_id") from None
        return LeaseGrant(lease_id=lease_id, ranks=[RankSections(rank=r, sections_b64=base64.b64encode(md).decode())
                                                    for r, md in sorted(sections.items())])

    @router.post("/leases/{lease_id}/bind", response_model=LeaseStatus)
    def bind(lease_id: str, body: LeaseClaim) -> LeaseStatus:
        if leases is None:
            raise APIError(404, "this node exports no leases")
        try:
            leases.bind(lease_id, body.reader)
        except ClaimRefused as exc:
            raise APIError(exc.status, str(exc), param="lease_id") from None
        return LeaseStatus(lease_id=lease_id, alive=True)

    @router.post("/leases/{lease_id}/abort", response_model=LeaseStatus)
    def abort(lease_id: str, body: LeaseClaim) -> LeaseStatus:
        if leases is None:
            raise APIError(404, "this node exports no leases")
        try:
            ended = leases.abort(lease_id, body.reader)
        except ClaimRefused as exc:
            raise APIError(exc.status, str(exc), param="lease_id") from None
        if not ended:
            raise APIError(404, f"lease {lease_id} has ended (expired, aborted or already read)", param="lease_id")
        return LeaseStatus(lease_id=lease_id, alive=False)

    return router


def fetch_metadata(host: str, port: int, auth: ClusterAuth, timeout_s: float = 5.0) -> InstanceMetadata:
    """GET the prefill instance's metadata, signed by `auth` (raises httpx errors on failure)."""
    resp = httpx.get(f"http://{host}:{port}/kv/metadata", timeout=timeout_s, auth=auth)
    resp.raise_for_status()
    return InstanceMetadata.model_validate(resp.json())

