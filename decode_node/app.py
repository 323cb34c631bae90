"""The decode node's FastAPI app: OpenAI endpoints (remote-prefill import or colocated generation),
/health, /v1/models, /metrics, /abort_requests. TP pool (`--tp B`) or DCP pool (`--dcp W`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from decode_node.admission import ImportQueue
from decode_node.handoff import HandoffGate
from decode_node.peers import PeerDirectory
from decode_node.remote import serve_remote
from decode_node.settings import Settings
from kv_transfer.geometry import Geometry
from node.app import NodeRuntime, build_app
from node.local import serve_local
from node.runtime import RankInfo, start_runtime, worker_config
from node.textgen import PreparedRequest
from serving.errors import APIError


def _handler(settings: Settings):  # noqa: ANN202 - returns the node's Handler
    async def handle(runtime: NodeRuntime, prepared: PreparedRequest, request: Request) -> Response:
        params = prepared.kv_params
        if params is not None and params.do_remote_decode:
            raise APIError(400, "this is a decode node: do_remote_decode requests go to a prefill node",
                           "kv_transfer_params")
        if params is not None and params.do_remote_prefill:
            return await serve_remote(runtime, prepared, request, params, settings.kv_load_failure_policy)
        return await serve_local(runtime, prepared, request)
    return handle


def create_app(settings: Settings) -> FastAPI:
    if settings.tp > 1 and settings.dcp > 1:
        raise ValueError("choose --tp B or --dcp W, not both")
    gate = HandoffGate(settings.handoff_secret())  # no secret and not insecure: refuse to start
    settings.resolved_kernels(settings.world_size, settings.dcp)  # kernels=fast where unsupported: refuse, saying why

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        world = settings.world_size
        config = worker_config(settings, "decode", dcp_size=settings.dcp)
        config = dataclasses.replace(config, tp_size=world)
        runtime = await asyncio.to_thread(start_runtime, settings, config, world)
        head: RankInfo = runtime.executor.startup_info[0]
        runtime.extras["geometry"] = Geometry(world, settings.dcp, head.block_size, head.layout_fingerprint)
        runtime.extras["peers"] = PeerDirectory(settings.prefill_peers, timeout_s=settings.kv.timeout_s)
        runtime.extras["handoffs"] = gate
        runtime.extras["import_queue"] = ImportQueue(settings.import_queue_depth, settings.import_queue_wait_s)
        app.state.runtime = runtime
        try:
            yield
        finally:
            app.state.runtime = None
            await runtime.extras["peers"].close()
            await asyncio.to_thread(runtime.executor.stop)

    return build_app(f"pdcluster decode node ({settings.pool})", _handler(settings), lifespan, settings)
