"""The HTTP surface both node kinds share: OpenAI endpoints, /health, /v1/models, /metrics, abort by id.

A node supplies a `NodeRuntime` (executor, tokenizer, limits, metrics) and a `handle` coroutine that
serves one prepared request; this module parses, validates, assigns request ids, watches for client
disconnects and answers errors as OpenAI JSON. Request ids: the `X-Request-Id` header when given (the
router sends the same id to both legs), else a fresh one; `/abort_requests` takes those ids.
Admission: a node holds at most `max_num_seqs + max_queued_requests` requests; beyond that, while it drains
(node/serving.py), or when a handler raises `NodeBusy`, the answer is 503 with Retry-After (the router's "shed",
never a link failure) and `pdcluster_node_requests_total{outcome="shed"}` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from node.executor import Executor
from node.metrics import NodeMetrics
from node.serving import Drain, GuardMiddleware, MetricsServer
from node.settings import NodeSettings
from node.textgen import SESSION_HEADER, Kind, Limits, PreparedRequest, Tokenizer, parse_session, prepare, render_chat
from serving import sse
from serving.errors import APIError, error_body
from serving.protocol import (
    AbortRequests,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


@dataclass
class NodeRuntime:
    """Everything a node's handlers use; built in the app's lifespan."""

    executor: Executor
    tokenizer: Tokenizer
    limits: Limits
    metrics: NodeMetrics
    model: str
    role: str
    weights_fingerprint: str | None = None
    """Weights + tokenizer identity reported in /v1/models (node/runtime.py `served_weights_fingerprint`)."""
    extras: dict[str, Any] = field(default_factory=dict)
    request_ids: dict[str, str] = field(default_factory=dict)
    """internal id -> external id of requests in flight here."""
    num_finished: int = 0
    """Requests that left this node (their rows went back): admission queues retry when it moves."""
    metrics_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises `refresh_load` (the API port and the metrics port both render /metrics)."""

    def new_request_id(self, header: str | None) -> str:
        external = header or uuid.uuid4().hex
        exports = self.extras.get("exports")
        taken = external in self.request_ids or (exports is not None and exports.holds(external))
        internal = f"{external}-{uuid.uuid4().hex[:8]}" if taken else external
        self.request_ids[internal] = external
        return internal

    def done(self, internal: str) -> None:
        if self.request_ids.pop(internal, None) is not None:
            self.num_finished += 1

    def render_metrics(self) -> bytes:
        with self.metrics_lock:
            self.refresh_load()
            self.metrics.requests_in_flight.set(len(self.request_ids))
            return self.metrics.render()

    def internal_ids(self, external: str) -> list[str]:
        return [i for i, e in self.request_ids.items() if e == external or i == external]

    def refresh_load(self) -> None:
        """Copy the ranks' latest load into the gauges, and their cumulative counters (summed over ranks)
        into the node counters."""
        stats = self.executor.state.stats
        if not stats:
            return
        head = stats[0]
        self.metrics.set_load(head.num_running, head.num_waiting, head.num_rows_used, head.num_rows_total)
        if self.executor.state.cache is not None:
            self.metrics.prefix_blocks.labels(role=self.role).set(self.executor.state.cache.blocks_cached)
        totals: dict[str, float] = {}
        for rank_stats in stats:
            for name, value in rank_stats.counters:
                totals[name] = totals.get(name, 0.0) + value
        for name, label, seconds in self.executor.state.take_timings():
            self.metrics.observe_timing(name, label, seconds)
        seen = self.extras.setdefault("counters_seen", {})
        for name, value in totals.items():
            delta = value - seen.get(name, 0.0)
            if delta > 0:
                self.metrics.add_counter(name, delta)
                seen[name] = value


Handler = Callable[[NodeRuntime, PreparedRequest, Request], Awaitable[Response]]


class NodeBusy(Exception):
    """The node cannot take this request now (no rows, full queue, draining): 503 with Retry-After."""


def shed_response(message: str, retry_after_s: int) -> JSONResponse:
    return JSONResponse(status_code=503, content=error_body(503, message),
                        headers={"Retry-After": str(retry_after_s)})


def runtime_of(request: Request) -> NodeRuntime:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise APIError(503, "the node is starting")
    return runtime


def streaming(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    return StreamingResponse(sse.with_done(chunks), media_type=sse.MEDIA_TYPE)


async def until_disconnect(request: Request, work: Awaitable[Any], poll_s: float = 0.1) -> Any:
    """Await `work`; if the client goes away first, cancel it (its cleanup aborts the request)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client closed the request")
    finally:
        if not task.done():
            task.cancel()


async def _release_after(chunks: AsyncIterator[Any], runtime: NodeRuntime, request_id: str) -> AsyncIterator[Any]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        runtime.done(request_id)


def _models(runtime: NodeRuntime) -> ModelList:
    return ModelList(data=[ModelCard(id=runtime.model, root=runtime.model, max_model_len=runtime.limits.max_context,
                                     weights_fingerprint=runtime.weights_fingerprint)])


def node_router(handle: Handler, settings: NodeSettings) -> APIRouter:
    """Routes shared by the prefill and decode nodes; `handle` serves one prepared request."""
    router = APIRouter()
    max_in_flight = settings.max_num_seqs + settings.max_queued_requests

    def _shed(runtime: NodeRuntime, message: str) -> Response:
        runtime.metrics.requests.labels(outcome="shed").inc()
        return shed_response(message, settings.retry_after_s)

    async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest, kind: Kind) -> Response:
        runtime = runtime_of(request)
        if not runtime.executor.healthy:
            raise APIError(503, f"the engine is down: {runtime.executor.state.error or 'not running'}")
        if request.app.state.drain.active:
            return _shed(runtime, "the node is shutting down; retry on another instance")
        if len(runtime.request_ids) >= max_in_flight:
            return _shed(runtime, f"the node holds {max_in_flight} requests (running + queued); retry later")
        runtime.metrics.requests.labels(outcome="admitted").inc()
        request_id = runtime.new_request_id(request.headers.get("x-request-id"))
        streaming_out = False
        try:
            session = parse_session(request.headers.get(SESSION_HEADER))
            prepared = prepare(body, kind, request_id, runtime.model, runtime.tokenizer, runtime.limits)
            if session:
                prepared = dataclasses.replace(prepared, session=session)
            try:
                response = await handle(runtime, prepared, request)
            except NodeBusy as exc:
                return _shed(runtime, str(exc))
            if isinstance(response, StreamingResponse):  # the id stays abortable until the stream ends
                response.body_iterator = _release_after(response.body_iterator, runtime, request_id)
                streaming_out = True
            return response
        finally:
            if not streaming_out:
                runtime.done(request_id)

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _serve(request, body, "completion")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await _serve(request, body, "chat")

    @router.get("/health")
    async def health(request: Request) -> Response:
        runtime = getattr(request.app.state, "runtime", None)
        if runtime is None or not runtime.executor.healthy:
            reason = runtime.executor.state.error if runtime else "starting"
            return JSONResponse(status_code=503, content=error_body(503, f"unhealthy: {reason}"))
        if request.app.state.drain.active:
            return shed_response("draining: the node is shutting down", settings.retry_after_s)
        return Response(status_code=200)

    @router.get("/v1/cache")
    async def cache(request: Request) -> Response:
        """What this node's prefix cache holds (docs/SESSIONS.md)."""
        report = runtime_of(request).executor.state.cache
        if report is None:
            raise APIError(503, "the engine has not reported its cache yet")
        return JSONResponse({"block_tokens": report.block_tokens, "fingerprint": report.fingerprint,
                             "sessions": dict(report.sessions), "resumable": dict(report.resumable),
                             "blocks_cached": report.blocks_cached, "rows_free": report.rows_free,
                             "hits_tokens": report.hits_tokens, "queried_tokens": report.queried_tokens,
                             "evicted_blocks": report.evicted_blocks, "tails": report.tails})

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return _models(runtime_of(request))

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        runtime = runtime_of(request)
        return Response(runtime.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.post("/tokenize")
    async def tokenize(request: Request, body: TokenizeRequest) -> TokenizeResponse:
        runtime = runtime_of(request)
        tok = runtime.tokenizer
        if body.messages is not None:
            ids = tok.encode_chat(body.messages) if hasattr(tok, "encode_chat") else tok.encode(render_chat(body.messages))
        else:
            ids = tok.encode(body.prompt or "")
        return TokenizeResponse(count=len(ids), max_model_len=runtime.limits.max_context, tokens=ids)

    @router.post("/abort_requests")
    async def abort_requests(request: Request, body: AbortRequests) -> dict[str, list[str]]:
        runtime = runtime_of(request)
        aborted = []
        for external in body.request_ids:
            for internal in runtime.internal_ids(external):
                runtime.executor.abort(internal)
                aborted.append(external)
            abort_hook = runtime.extras.get("abort_hook")
            if abort_hook is not None and abort_hook(external):
                aborted.append(external)
        return {"aborted": sorted(set(aborted))}

    return router


def _with_metrics_port(lifespan: Any, settings: NodeSettings) -> Any:
    """The node's lifespan plus, with `metrics_port` set, the metrics server for its whole life."""
    @contextlib.asynccontextmanager
    async def wrapped(app: FastAPI) -> Any:
        async with lifespan(app):
            server = None
            if settings.metrics_port is not None:
                def render() -> bytes:
                    runtime = getattr(app.state, "runtime", None)
                    return runtime.render_metrics() if runtime is not None else b""
                server = MetricsServer(settings.host, settings.metrics_port, render)
                await asyncio.to_thread(server.start)
            try:
                yield
            finally:
                if server is not None:
                    await asyncio.to_thread(server.stop)
    return wrapped


def build_app(title: str, handle: Handler, lifespan: Any, settings: NodeSettings) -> FastAPI:
    from serving.errors import install_error_handlers

    app = FastAPI(title=title, lifespan=_with_metrics_port(lifespan, settings))
    install_error_handlers(app)
    app.include_router(node_router(handle, settings))
    app.add_middleware(GuardMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_read_timeout_s=settings.body_read_timeout_s,
                       write_timeout_s=settings.stream_write_timeout_s)
    app.state.drain = Drain(settings.drain_s)

    def num_in_flight() -> int:
        """What a drain waits for: requests here, and on a prefill node the leases readers may still read."""
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:
            return 0
        exports = runtime.extras.get("exports")
        return len(runtime.request_ids) + (exports.num_outstanding if exports is not None else 0)
    app.state.num_in_flight = num_in_flight
    return app
