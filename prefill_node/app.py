"""The prefill node's FastAPI app: OpenAI endpoints (remote-decode export or colocated generation),
/health, /v1/models, /metrics, /abort_requests and the NIXL side channel (agent metadata of every rank).

Its ranks run the shared worker with `RankExporter` (prefill_node/rank_exporter.py) as their role; its
runtime's hand-off owner is the `Exporter` (kv_transfer/exporter.py); an export request (the P leg) is served by
node/export.py `serve_export`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kv_transfer.exporter import Exporter, ExportIdentity
from kv_transfer.side_channel import InstanceMetadata, side_channel_router
from node.app import build_app
from node.executor import Executor
from node.export import serve_export
from node.local import serve_local
from node.metrics import NodeMetrics
from node.rank import RankInfo
from node.runtime import NodeRuntime, start_runtime, worker_config
from node.textgen import PreparedRequest
from prefill_node.settings import Settings
from serving.errors import APIError

RANK_EXPORTER = "prefill_node.rank_exporter:build_rank_exporter"
"""The prefill ranks' RankRole factory (node/rank.py `WorkerConfig.rank_role`)."""


async def handle(runtime: NodeRuntime[Exporter], prepared: PreparedRequest, request: Request) -> Response:
    params = prepared.kv_params
    if params is not None and params.do_remote_decode:
        return await serve_export(runtime, runtime.handoff, prepared, request)
    return await serve_local(runtime, prepared, request)


def _exporter(settings: Settings) -> Callable[[Executor, NodeMetrics], Exporter]:
    """Builds the node's Exporter once its ranks reported their layout."""
    def build(executor: Executor, metrics: NodeMetrics) -> Exporter:
        head: RankInfo = executor.startup_info[0]
        identity = ExportIdentity(engine_id=settings.engine_id, host=settings.public_host, port=settings.port,
                                  tp_size=settings.tp, block_size=head.block_size,
                                  subblock_tokens=head.subblock_tokens, layout_fingerprint=head.layout_fingerprint)
        return Exporter(identity, executor, metrics, settings.lease_seconds, secret=settings.handoff_secret(),
                        require_reader=settings.require_reader)
    return build


async def _sweep(exporter: Exporter, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        exporter.sweep()


def create_app(settings: Settings) -> FastAPI:
    settings.handoff_secret()  # no secret and not insecure: refuse to start (the message names the settings)
    settings.resolved_kernels(settings.tp)  # kernels=fast where the ranks cannot run it: refuse to start, saying why

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = worker_config(settings, "prefill", token_shard_min_tokens=settings.token_shard_min_tokens,
                               rank_role=RANK_EXPORTER)
        runtime = await asyncio.to_thread(start_runtime, settings, config, settings.tp, _exporter(settings))
        app.state.runtime = runtime
        sweeper = asyncio.create_task(_sweep(runtime.handoff, settings.lease_sweep_s))
        try:
            yield
        finally:
            sweeper.cancel()
            app.state.runtime = None
            await asyncio.to_thread(runtime.executor.stop)

    def running() -> NodeRuntime[Exporter]:
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:
            raise APIError(503, "the node is starting")
        return runtime

    def metadata() -> InstanceMetadata:
        return InstanceMetadata.from_ranks(settings.engine_id, settings.engine.model,
                                           running().executor.startup_info, tp_size=settings.tp)

    app = build_app("pdcluster prefill node", handle, lifespan, settings)
    app.include_router(side_channel_router(metadata, app.state.control_guard, _LeaseControl(running)))
    return app


class _LeaseControl:
    """The running node's Exporter as the side channel's lease control (it exists once the lifespan started)."""

    def __init__(self, running: Callable[[], NodeRuntime[Exporter]]) -> None:
        self._running = running

    def abort(self, lease_id: str, reader: str) -> bool:
        return self._running().handoff.abort_lease(lease_id, reader)

    def claim(self, lease_id: str, reader: str) -> dict[int, bytes]:
        return self._running().handoff.claim(lease_id, reader)

    def bind(self, lease_id: str, reader: str) -> None:
        self._running().handoff.bind(lease_id, reader)
