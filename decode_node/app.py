"""The decode node's FastAPI app: OpenAI endpoints (remote-prefill import, colocated generation, or on a TP pool the
export of a session that outgrows it: node/export.py), /health, /v1/models, /metrics, /abort_requests, and the NIXL
side channel (agent metadata of every rank, the claim and abort of the leases on streams it moves out on drain,
decode_node/moves.py, and on sessions it exports). TP pool (`--tp B`) or DCP pool (`--dcp W`).

Its ranks run the shared worker with `RankImporter` (decode_node/rank_importer.py) as their role; its runtime's
hand-off owner is the `Importer` (decode_node/importer.py), which holds the node's `Moves`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from decode_node.admission import ImportQueue
from decode_node.handoff import HandoffGate
from decode_node.importer import Importer, serve_here, serve_remote
from decode_node.moves import Moves
from decode_node.peers import PeerDirectory
from decode_node.settings import Settings
from kv_transfer.exporter import Exporter, ExportIdentity
from kv_transfer.geometry import Geometry
from kv_transfer.side_channel import InstanceMetadata, side_channel_router
from node.app import build_app
from node.executor import Executor
from node.export import serve_export
from node.metrics import NodeMetrics
from node.rank import RankInfo
from node.runtime import NodeRuntime, start_runtime, worker_config
from node.textgen import PreparedRequest
from serving.errors import APIError

RANK_IMPORTER = "decode_node.rank_importer:build_rank_importer"
"""The decode ranks' RankRole factory (node/rank.py `WorkerConfig.rank_role`)."""


async def serve_session_export(runtime: NodeRuntime[Importer], prepared: PreparedRequest,
                               request: Request) -> Response:
    """A session moving to another pool: prefill the new turn on top of this node's prefix cache and lease the whole
    prompt's rows to the new instance (node/export.py; the router's session-growth move, docs/ARCHITECTURE.md)."""
    exporter = runtime.handoff.moves.exporter
    if exporter is None:
        raise APIError(400, "this decode node exports no rows (a DCP pool, no KV transport, or move_on_drain off): "
                            "send do_remote_decode requests to a prefill node", "kv_transfer_params")
    return await serve_export(runtime, exporter, prepared, request, transfer_mode="move")


async def handle(runtime: NodeRuntime[Importer], prepared: PreparedRequest, request: Request) -> Response:
    params = prepared.kv_params
    if params is not None and params.do_remote_decode:
        return await serve_session_export(runtime, prepared, request)
    if params is not None and params.do_remote_prefill:
        return await serve_remote(runtime, prepared, request, params)
    return await serve_here(runtime, prepared, request)


def _moves(settings: Settings, executor: Executor, metrics: NodeMetrics, head: RankInfo) -> Moves:
    """What this node moves out on drain: nothing on a DCP pool (a reader's remap takes TP rows) or without a
    transport (no rank endpoint to read from)."""
    if not settings.move_on_drain or settings.dcp > 1 or head.endpoint is None:
        return Moves(None, settings.move_wait_s)
    identity = ExportIdentity(engine_id=settings.engine_id, host=settings.public_host, port=settings.port,
                              tp_size=settings.world_size, block_size=head.block_size,
                              subblock_tokens=head.subblock_tokens, layout_fingerprint=head.layout_fingerprint)
    exporter = Exporter(identity, executor, metrics, settings.move_lease_s, secret=settings.handoff_secret(),
                        require_reader=settings.require_reader)
    return Moves(exporter, settings.move_wait_s)


def _importer(settings: Settings, gate: HandoffGate, peers: PeerDirectory
              ) -> Callable[[Executor, NodeMetrics], Importer]:
    """Builds the node's Importer once its ranks reported their layout."""
    def build(executor: Executor, metrics: NodeMetrics) -> Importer:
        head: RankInfo = executor.startup_info[0]
        return Importer(gate=gate, peers=peers,
                        queue=ImportQueue(settings.import_queue_depth, settings.import_queue_wait_s),
                        geometry=Geometry(settings.world_size, settings.dcp, head.block_size, head.layout_fingerprint),
                        policy=settings.kv_load_failure_policy, moves=_moves(settings, executor, metrics, head))
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
        sweeper = asyncio.create_task(_sweep(runtime.handoff.moves.exporter, settings.move_lease_s / 4))
        try:
            yield
        finally:
            sweeper.cancel()
            app.state.runtime = None
            await peers.close()
            await asyncio.to_thread(runtime.executor.stop)

    def running() -> NodeRuntime[Importer]:
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:
            raise APIError(503, "the node is starting")
        return runtime

    def metadata() -> InstanceMetadata:
        return InstanceMetadata.from_ranks(settings.engine_id, settings.engine.model,
                                           running().executor.startup_info, tp_size=settings.world_size, dcp_size=settings.dcp)

    app = build_app(f"pdcluster decode node ({settings.pool})", handle, lifespan, settings)
    app.include_router(side_channel_router(metadata, app.state.control_guard, _MoveLeases(running)))
    default_hand_off = app.state.hand_off

    def hand_off() -> None:
        """Move the running streams with their KV (decode_node/moves.py); without moves, end them with a 503."""
        runtime = getattr(app.state, "runtime", None)
        if runtime is None or runtime.handoff.moves.exporter is None:
            default_hand_off()
            return
        runtime.handoff.moves.hand_off(runtime)
    app.state.hand_off = hand_off
    return app


async def _sweep(exporter: Exporter | None, every_s: float) -> None:
    while exporter is not None:
        await asyncio.sleep(every_s)
        exporter.sweep()


class _MoveLeases:
    """The leases on moved streams as the side channel's lease control (kv_transfer/side_channel.py)."""

    def __init__(self, running: Callable[[], NodeRuntime[Importer]]) -> None:
        self._running = running

    def _exporter(self) -> Exporter:
        exporter = self._running().handoff.moves.exporter
        if exporter is None:
            raise APIError(404, "this decode node moves no stream out")
        return exporter

    def abort(self, lease_id: str, reader: str) -> bool:
        return self._exporter().abort_lease(lease_id, reader)

    def claim(self, lease_id: str, reader: str) -> dict[int, bytes]:
        return self._exporter().claim(lease_id, reader)

    def bind(self, lease_id: str, reader: str) -> None:
        self._exporter().bind(lease_id, reader)
