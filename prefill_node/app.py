"""The prefill node's FastAPI app: OpenAI endpoints (remote-decode export or colocated generation),
/health, /v1/models, /metrics, /abort_requests and the NIXL side channel (agent metadata of every rank).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kv_transfer.side_channel import InstanceMetadata, RankMetadata, side_channel_router
from node.app import NodeRuntime, build_app
from node.local import serve_local
from node.runtime import RankInfo, start_runtime, worker_config
from node.textgen import PreparedRequest
from prefill_node.export import serve_export
from prefill_node.exports import ExportIdentity, ExportTable
from prefill_node.settings import Settings
from serving.errors import APIError


async def handle(runtime: NodeRuntime, prepared: PreparedRequest, request: Request) -> Response:
    params = prepared.kv_params
    if params is not None and params.do_remote_decode:
        return await serve_export(runtime, prepared, request)
    return await serve_local(runtime, prepared, request)


def _attach_exports(runtime: NodeRuntime, settings: Settings) -> ExportTable:
    head: RankInfo = runtime.executor.startup_info[0]
    identity = ExportIdentity(engine_id=settings.engine_id, host=settings.public_host, port=settings.port,
                              tp_size=settings.tp, block_size=head.block_size, subblock_tokens=head.subblock_tokens,
                              layout_fingerprint=head.layout_fingerprint)
    table = ExportTable(identity, runtime.executor, runtime.metrics, settings.lease_seconds,
                        secret=settings.handoff_secret())
    runtime.executor.on_notice(table.on_notice)
    runtime.extras["exports"] = table
    runtime.extras["abort_hook"] = lambda external: table.abort(external, runtime.internal_ids(external))
    return table


async def _sweep(table: ExportTable, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        table.sweep()


def create_app(settings: Settings) -> FastAPI:
    settings.handoff_secret()  # no secret and not insecure: refuse to start (the message names the settings)
    settings.resolved_kernels(settings.tp)  # kernels=fast where the ranks cannot run it: refuse to start, saying why

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = worker_config(settings, "prefill", token_shard_min_tokens=settings.token_shard_min_tokens)
        runtime = await asyncio.to_thread(start_runtime, settings, config, settings.tp)
        table = _attach_exports(runtime, settings)
        app.state.runtime = runtime
        sweeper = asyncio.create_task(_sweep(table, settings.lease_sweep_s))
        try:
            yield
        finally:
            sweeper.cancel()
            app.state.runtime = None
            await asyncio.to_thread(runtime.executor.stop)

    def metadata() -> InstanceMetadata:
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:
            raise APIError(503, "the node is starting")
        ranks: list[RankInfo] = runtime.executor.startup_info
        head = ranks[0]
        return InstanceMetadata(
            engine_id=settings.engine_id, model=settings.model, layout_fingerprint=head.layout_fingerprint,
            tp_size=settings.tp, block_size=head.block_size, subblock_tokens=head.subblock_tokens,
            row_bytes=head.row_bytes, num_rows=head.num_rows, kda_groups=head.kda_groups,
            ranks=[RankMetadata.from_endpoint(info.endpoint) for info in ranks if info.endpoint is not None])

    app = build_app("pdcluster prefill node", handle, lifespan, settings)
    app.include_router(side_channel_router(metadata, _LazyExports(app)))
    return app


class _LazyExports:
    """The running app's ExportTable as the side channel's lease aborter (it exists once the lifespan started)."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app

    def abort(self, lease_id: str) -> bool:
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is None:
            raise APIError(503, "the node is starting")
        return runtime.extras["exports"].abort_lease(lease_id)
