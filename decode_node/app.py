"""The decode node's FastAPI app: OpenAI endpoints (remote-prefill import or colocated generation),
/health, /v1/models, /metrics, /abort_requests. TP pool (`--tp B`) or DCP pool (`--dcp W`).

Its ranks run the shared worker with `RankImporter` (decode_node/rank_importer.py) as their role; its runtime's
hand-off owner is the `Importer` (decode_node/importer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from decode_node.admission import ImportQueue
from decode_node.handoff import HandoffGate
from decode_node.importer import Importer, serve_remote
from decode_node.peers import PeerDirectory
from decode_node.settings import Settings
from kv_transfer.geometry import Geometry
from node.app import build_app
from node.executor import Executor
from node.local import serve_local
from node.metrics import NodeMetrics
from node.rank import RankInfo
from node.runtime import NodeRuntime, start_runtime, worker_config
from node.textgen import PreparedRequest
from serving.errors import APIError

RANK_IMPORTER = "decode_node.rank_importer:build_rank_importer"
"""The decode ranks' RankRole factory (node/rank.py `WorkerConfig.rank_role`)."""


async def handle(runtime: NodeRuntime[Importer], prepared: PreparedRequest, request: Request) -> Response:
    params = prepared.kv_params
    if params is not None and params.do_remote_decode:
        raise APIError(400, "this is a decode node: do_remote_decode requests go to a prefill node",
                       "kv_transfer_params")
    if params is not None and params.do_remote_prefill:
        return await serve_remote(runtime, prepared, request, params)
    return await serve_local(runtime, prepared, request)


def _importer(settings: Settings, gate: HandoffGate, peers: PeerDirectory
              ) -> Callable[[Executor, NodeMetrics], Importer]:
    """Builds the node's Importer once its ranks reported their layout."""
    def build(executor: Executor, metrics: NodeMetrics) -> Importer:
        head: RankInfo = executor.startup_info[0]
        return Importer(gate=gate, peers=peers,
                        queue=ImportQueue(settings.import_queue_depth, settings.import_queue_wait_s),
                        geometry=Geometry(settings.world_size, settings.dcp, head.block_size, head.layout_fingerprint),
                        policy=settings.kv_load_failure_policy)
    return build


def create_app(settings: Settings) -> FastAPI:
    if settings.tp > 1 and settings.dcp > 1:
        raise ValueError("choose --tp B or --dcp W, not both")
    secret = settings.handoff_secret()  # no secret and not insecure: refuse to start
    gate = HandoffGate(secret, settings.engine_id)
    settings.resolved_kernels(settings.world_size, settings.dcp)  # kernels=fast where unsupported: refuse, saying why

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        world = settings.world_size
        config = worker_config(settings, "decode", dcp_size=settings.dcp, rank_role=RANK_IMPORTER, tp_size=world)
        peers = PeerDirectory(settings.prefill_peers, timeout_s=settings.kv.timeout_s, secret=secret)
        try:
            runtime = await asyncio.to_thread(start_runtime, settings, config, world,
                                              _importer(settings, gate, peers))
        except BaseException:
            await peers.close()
            raise
        app.state.runtime = runtime
        try:
            yield
        finally:
            app.state.runtime = None
            await peers.close()
            await asyncio.to_thread(runtime.executor.stop)

    return build_app(f"pdcluster decode node ({settings.pool})", handle, lifespan, settings)
