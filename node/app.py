"""The HTTP surface both node kinds share: OpenAI endpoints, /health, /v1/models, /metrics, abort by id.

A node supplies a `NodeRuntime` (node/runtime.py: executor, tokenizer, limits, metrics, its hand-off owner) and
a `handle` coroutine that serves one prepared request; this module parses, validates, assigns request ids,
watches for client disconnects and answers errors as OpenAI JSON. Request ids: the `X-Request-Id` header when given (the
router sends the same id to both legs), else a fresh one; `/abort_requests` takes those ids.
Control routes (`/abort_requests`, `/v1/cache`; the prefill node's `/kv/...`) answer only requests signed with
the cluster secret (kv_transfer/cluster_auth.py, 401 otherwise): they act on or reveal other clients' requests.
The OpenAI routes, `/tokenize`, `/v1/models`, `/health` and `/metrics` stay open to whoever reaches the port.
Admission: a node holds at most `max_num_seqs + max_queued_requests` requests; beyond that, while it drains
(node/serving.py), or when a handler raises `NodeBusy`, the answer is 503 with Retry-After (the router's "shed",
never a link failure) and `pdcluster_node_requests_total{outcome="shed"}` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kv_transfer.cluster_auth import ControlGuard
from node.runtime import NodeRuntime
from node.serving import Drain, GuardMiddleware, MetricsServer
from node.settings import NodeSettings
from node.textgen import SESSION_HEADER, TENANT_HEADER, Kind, PreparedRequest, parse_session, parse_tenant, prepare
from serving import sse
from serving.errors import DRAINING_HEADER, APIError, error_body
from serving.protocol import (
    AbortRequests,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

Handler = Callable[[NodeRuntime, PreparedRequest, Request], Awaitable[Response]]

log = logging.getLogger("pdcluster.node")


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


MAX_REQUEST_ID_CHARS = 256


def parse_request_id(value: str | None) -> str | None:
    """The `X-Request-Id` header: absent or empty -> None (the node makes one), else 1..256 visible ASCII
    characters (it becomes the response's id and the abort key), anything else a 400 naming it."""
    if not value:
        return None
    if len(value) > MAX_REQUEST_ID_CHARS or not all("!" <= ch <= "~" for ch in value):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters",
                       "X-Request-Id")
    return value


def _models(runtime: NodeRuntime) -> ModelList:
    return ModelList(data=[ModelCard(id=runtime.model, root=runtime.model, max_model_len=runtime.limits.max_context,
                                     weights_fingerprint=runtime.weights_fingerprint)])


def node_router(handle: Handler, settings: NodeSettings, guard: ControlGuard) -> APIRouter:
    """Routes shared by the prefill and decode nodes; `handle` serves one prepared request; `guard` admits the
    control routes' callers."""
    router = APIRouter()
    control = [Depends(guard.check)]
    max_in_flight = settings.engine.max_batch + settings.max_queued_requests

    def _shed(runtime: NodeRuntime, message: str, draining: bool = False) -> Response:
        runtime.metrics.requests.labels(outcome="shed").inc()
        response = shed_response(message, settings.retry_after_s)
        if draining:
            response.headers[DRAINING_HEADER] = "1"
        return response

    async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest, kind: Kind) -> Response:
        runtime = runtime_of(request)
        if not runtime.executor.healthy:
            raise APIError(503, f"the engine is down: {runtime.executor.state.error or 'not running'}")
        if request.app.state.drain.active:
            return _shed(runtime, "the node is shutting down; retry on another instance", draining=True)
        if len(runtime.request_ids) >= max_in_flight:
            return _shed(runtime, f"the node holds {max_in_flight} requests (running + queued); retry later")
        external_id = parse_request_id(request.headers.get("x-request-id"))
        runtime.metrics.requests.labels(outcome="admitted").inc()
        request_id = runtime.new_request_id(external_id)
        streaming_out = False
        try:
            session = parse_session(request.headers.get(SESSION_HEADER))
            tenant = parse_tenant(request.headers.get(TENANT_HEADER))
            prepared = prepare(body, kind, request_id, runtime.model, runtime.tokenizer, runtime.limits, tenant)
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

    @router.get("/v1/cache", dependencies=control)
    async def cache(request: Request) -> Response:
        """What this node's prefix cache holds (docs/SESSIONS.md), and its engine id (the router names a decode
        node's as the reader of the hand-offs it asks a prefill node for: kv_transfer/params.py)."""
        report = runtime_of(request).executor.state.cache
        if report is None:
            raise APIError(503, "the engine has not reported its cache yet")
        return JSONResponse({"engine_id": settings.engine_id, "block_tokens": report.block_tokens, "fingerprint": report.fingerprint,
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
        """The ids a completion's prompt or a chat's messages become here (the served model's tokenizer)."""
        runtime = runtime_of(request)
        if body.model is not None and body.model != runtime.model:
            raise APIError(404, f"The model `{body.model}` does not exist; this node serves `{runtime.model}`", "model",
                           "NotFoundError")
        tok = runtime.tokenizer
        if body.messages is not None:
            try:
                ids = tok.encode_chat(body.messages, body.add_generation_prompt)
            except ValueError as exc:
                raise APIError(400, str(exc), "messages") from exc
        else:
            ids = tok.encode(body.prompt or "", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=runtime.limits.max_context, tokens=ids)

    @router.post("/abort_requests", dependencies=control)
    async def abort_requests(request: Request, body: AbortRequests) -> dict[str, list[str]]:
        runtime = runtime_of(request)
        aborted = []
        for external in body.request_ids:
            internal_ids = runtime.internal_ids(external)
            # the hand-off first: from then on nothing can claim the rows, so it knows whether a READ still may
            outcome = runtime.handoff.abort(external, internal_ids)
            if outcome.ended:
                aborted.append(external)
            for internal in internal_ids:
                runtime.executor.abort(internal, reads_done=outcome.reads_done)
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
                server = MetricsServer(settings.host, settings.metrics_port, render, settings.http_head_timeout_s)
                await asyncio.to_thread(server.start)
            try:
                yield
            finally:
                if server is not None:
                    await asyncio.to_thread(server.stop)
    return wrapped


def build_app(title: str, handle: Handler, lifespan: Any, settings: NodeSettings) -> FastAPI:
    """The node's app; `app.state.control_guard` checks its control routes (the prefill node's side channel too)."""
    from serving.errors import install_error_handlers

    app = FastAPI(title=title, lifespan=_with_metrics_port(lifespan, settings))
    install_error_handlers(app)
    guard = ControlGuard(settings.handoff_secret())
    app.state.control_guard = guard
    app.include_router(node_router(handle, settings, guard))
    app.add_middleware(GuardMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_read_timeout_s=settings.body_read_timeout_s,
                       write_timeout_s=settings.stream_write_timeout_s)
    app.state.drain = Drain(settings.drain_s)

    def num_in_flight() -> int:
        """What a drain waits for: requests here, and on a prefill node the leases readers may still read."""
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:
            return 0
        return len(runtime.request_ids) + runtime.handoff.num_outstanding
    app.state.num_in_flight = num_in_flight

    def hand_off() -> None:
        """End the requests still running with a 503 naming the drain: a router that resumes moves them."""
        runtime = getattr(app.state, "runtime", None)
        if runtime is not None:
            num = runtime.executor.end_all("the node is draining: continue on another instance", status=503)
            log.warning("draining: handed off %d running request(s)", num)
    app.state.hand_off = hand_off
    return app
