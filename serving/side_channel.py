"""The prefill node's side channel over HTTP (vLLM uses ZMQ on VLLM_NIXL_SIDE_CHANNEL_PORT; ours rides on
the node's own port, which is the `remote_port` in the params):

- `GET /kv_transfer/metadata`: engine id, layout facts and each rank's NIXL agent metadata (base64), all a
  reader needs to check params (`kv_transfer.params.check_readable`) and to add the remote agents.
- `POST /kv_transfer/heartbeat` {request_id, lease_id}: the reader extends the lease while it waits.
- `POST /kv_transfer/release` {request_id, lease_id}: the reader gives the rows back without reading
  (rejected before admission, or after a failed read).
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request
from pydantic import BaseModel

from kv_transfer.transport import RankEndpoint
from serving.errors import APIError
from serving.node_app import runtime_of


class PeerRank(BaseModel):
    """One prefill rank's registered pool (kv_transfer.transport.RankEndpoint on the wire)."""

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
    def of(cls, endpoint: RankEndpoint) -> "PeerRank":
        return cls(rank=endpoint.rank, agent_name=endpoint.agent_name,
                   agent_metadata_b64=base64.b64encode(endpoint.agent_metadata).decode(),
                   base_addr=endpoint.base_addr, pool_bytes=endpoint.pool_bytes, row_bytes=endpoint.row_bytes,
                   num_rows=endpoint.num_rows, mem_type=endpoint.mem_type, device_id=endpoint.device_id)

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint(rank=self.rank, agent_name=self.agent_name,
                            agent_metadata=base64.b64decode(self.agent_metadata_b64), base_addr=self.base_addr,
                            pool_bytes=self.pool_bytes, row_bytes=self.row_bytes, num_rows=self.num_rows,
                            mem_type=self.mem_type, device_id=self.device_id)


class SideChannelInfo(BaseModel):
    engine_id: str
    model: str
    tp_size: int
    num_rows: int
    block_size: int
    subblock_tokens: int
    layout_fingerprint: str
    kda_groups: int
    ranks: list[PeerRank]


class LeaseRef(BaseModel):
    request_id: str
    lease_id: str


def side_channel_router() -> APIRouter:
    router = APIRouter(prefix="/kv_transfer")

    @router.get("/metadata")
    async def metadata(request: Request) -> SideChannelInfo:
        runtime = runtime_of(request)
        table = runtime.extras["exports"]
        ranks = [PeerRank.of(info.endpoint) for info in runtime.executor.startup_info if info.endpoint]
        head = runtime.executor.startup_info[0]
        ident = table.identity
        return SideChannelInfo(engine_id=ident.engine_id, model=runtime.model, tp_size=ident.tp_size,
                               num_rows=head.num_rows, block_size=ident.block_size,
                               subblock_tokens=ident.subblock_tokens, layout_fingerprint=ident.layout_fingerprint,
                               kda_groups=head.kda_groups, ranks=ranks)

    @router.post("/heartbeat")
    async def heartbeat(request: Request, body: LeaseRef) -> dict[str, float]:
        expiry = runtime_of(request).extras["exports"].extend(body.lease_id)
        if expiry is None:
            raise APIError(404, f"no lease {body.lease_id!r} for request {body.request_id!r} (expired or freed)",
                           "lease_id")
        return {"lease_expiry": expiry}

    @router.post("/release")
    async def release(request: Request, body: LeaseRef) -> dict[str, bool]:
        return {"released": runtime_of(request).extras["exports"].release(body.lease_id)}

    return router
