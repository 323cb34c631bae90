"""One client request end to end: validate, place, run the legs, answer, account.

`serve()` is what the completion handlers call. It races the work against a client disconnect (for the
phase before the response starts; the streaming relay handles the rest), fills the metrics, and keeps
the session table current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from router.placement import NoPlacement, RequestShape, SessionRecord, estimate_prompt_tokens, place, \
    session_id_of
from router.proxy import Orchestrator, RequestContext, UpstreamReply, upstream_message
from router.relay import StreamAccounting, relay
from router.state import RouterState
from router.validation import Endpoint, parse_body, validate
from serving.errors import APIError, error_response

log = logging.getLogger("router")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def until_disconnect(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it (its cleanup aborts the legs)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


async def read_limited(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (413) as soon as it grows past `max_bytes`."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise APIError(413, f"request body is more than the limit of {max_bytes} bytes")
        parts.append(part)
    return b"".join(parts)


def _shape(state: RouterState, request: Request, body: dict) -> RequestShape:
    s = state.settings
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or s.default_max_tokens
    hint = request.headers.get("x-expected-context-tokens")
    growth = int(hint) if hint and hint.isdigit() else s.session_growth_tokens
    return RequestShape(session_id=session_id_of(request.headers, body),
                        prompt_tokens=estimate_prompt_tokens(body, s.chars_per_token),
                        max_tokens=int(max_tokens), expected_growth_tokens=growth)


def _context(state: RouterState, request: Request, endpoint: Endpoint, raw: bytes) -> RequestContext:
    s = state.settings
    body = parse_body(raw, s.max_body_bytes)
    known = {str(card["id"]) for card in state.registry.served_models()}
    valid = validate(body, endpoint, known, s.max_tokens_limit)
    shape = _shape(state, request, valid.body)
    now = time.monotonic()
    session = state.sessions.get(shape.session_id, now) if shape.session_id else None
    instances = state.registry.snapshot()
    try:
        placement = place(shape, session, state.pool_views(instances), instances, state.usable_pairs(now),
                          frozenset(state.warm_pairs), s.disagg_min_uncached_tokens)
    except NoPlacement as exc:
        raise APIError(503, f"no decode instance available: {exc}") from None
    if shape.session_id:
        known_tokens = max(shape.prompt_tokens, session.context_tokens if session else 0)
        state.sessions.put(SessionRecord(shape.session_id, placement.pool, placement.decode, known_tokens, now))
    # Always the router's own id: a client-chosen one could collide with (and abort) another request.
    request_id = f"pdc-{uuid.uuid4().hex}"
    return RequestContext(request_id=request_id, path=PATHS[endpoint], valid=valid, shape=shape,
                          placement=placement, started=now)


def _route_headers(ctx: RequestContext) -> dict[str, str]:
    headers = {"X-Request-Id": ctx.request_id, "X-PDCluster-Pool": ctx.placement.pool,
               "X-PDCluster-Decode": ctx.placement.decode,
               "X-PDCluster-Prefill": ctx.handoff.prefill if ctx.handoff else "none"}
    if ctx.placement.is_migration:
        headers["X-PDCluster-Migrated"] = "true"
    return headers


def finish(state: RouterState, ctx: RequestContext, acct: StreamAccounting | None, usage: dict | None) -> None:
    """Metrics and session bookkeeping once a request ended (any outcome)."""
    m, pool, model = state.metrics, ctx.placement.pool, ctx.valid.model
    now = time.monotonic()
    m.requests.labels(ctx.outcome, pool).inc()
    if ctx.outcome != "ok":
        prefill = ctx.handoff.prefill if ctx.handoff else "none"
        log.warning("request %s %s (pool %s, decode %s, prefill %s) after %.2f s%s", ctx.request_id, ctx.outcome,
                    pool, ctx.placement.decode, prefill, now - ctx.started, f": {ctx.error}" if ctx.error else "")
    if ctx.prefill_s is not None:
        m.leg.labels("prefill", pool).observe(ctx.prefill_s)
    if ctx.kv_transfer_s is not None:
        m.leg.labels("kv_transfer", pool).observe(ctx.kv_transfer_s)
    if ctx.first_decode_s is not None:
        m.leg.labels("first_decode", pool).observe(ctx.first_decode_s)
    if ctx.outcome != "ok":
        return
    e2e = now - ctx.started
    m.e2e.labels(pool, model).observe(e2e)
    if acct is not None and acct.ttft_s is not None:
        m.ttft.labels(pool, model).observe(acct.ttft_s)
        for gap in acct.itls():
            m.itl.labels(pool, model).observe(gap)
        num_out = (usage or {}).get("completion_tokens") or acct.num_token_events
        if num_out > 1:
            m.tpot.labels(pool, model).observe((e2e - acct.ttft_s) / (num_out - 1))
    if ctx.shape.session_id and usage:
        total = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        state.sessions.put(SessionRecord(ctx.shape.session_id, pool, ctx.placement.decode, total, now))


class _StreamEnd:
    """Runs the end-of-stream bookkeeping exactly once (relay's finally, or the response's background
    task when the client left before the relay started)."""

    def __init__(self, state: RouterState, orch: Orchestrator, ctx: RequestContext, acct: StreamAccounting,
                 resp) -> None:
        self.state, self.orch, self.ctx, self.acct, self.resp = state, orch, ctx, acct, resp
        self.is_done = False

    def __call__(self, status: str) -> None:
        if self.is_done:
            return
        self.is_done = True
        decode = self.state.registry.get(self.ctx.placement.decode)
        if decode is not None:
            decode.num_inflight -= 1
        self.ctx.outcome = status
        if status != "ok":
            self.orch.abort_legs(self.ctx)
        if status == "upstream_error":
            self.ctx.error = self.acct.error or "decode stream ended without [DONE] or broke"
            self.orch.record_decode_status(self.ctx, None)
        if status == "timeout":
            self.state.metrics.leg_timeouts.labels("decode").inc()
        finish(self.state, self.ctx, self.acct, self.acct.usage)

    async def background(self) -> None:
        if not self.is_done:
            await self.resp.aclose()
            self("cancelled")


async def _run(state: RouterState, orch: Orchestrator, ctx: RequestContext) -> Response:
    if ctx.placement.disaggregate:
        ctx.handoff = await orch.prefill(ctx)
    if not ctx.valid.is_stream:
        resp = await orch.decode_json(ctx)
        usage = None
        if resp.status_code == 200:
            with contextlib.suppress(ValueError):
                usage = resp.json().get("usage")
        else:
            ctx.outcome = "client_error" if resp.status_code < 500 else "upstream_error"
            ctx.error = f"decode answered {resp.status_code}{upstream_message(resp.content)}"
        finish(state, ctx, None, usage)
        return Response(content=resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"), headers=_route_headers(ctx))
    resp, chunks, first = await orch.open_stream(ctx)
    acct = StreamAccounting(ctx.started)
    end = _StreamEnd(state, orch, ctx, acct, resp)
    return StreamingResponse(relay(resp, chunks, first, acct, state.settings.stream_idle_timeout_s, end),
                             media_type="text/event-stream", headers=_route_headers(ctx),
                             background=BackgroundTask(end.background))


async def serve(state: RouterState, request: Request, endpoint: Endpoint) -> Response:
    """Handle one /v1/completions or /v1/chat/completions request."""
    try:
        length = int(request.headers.get("content-length") or 0)
        if length > state.settings.max_body_bytes:
            raise APIError(413, f"request body is {length} bytes, more than the limit of "
                                f"{state.settings.max_body_bytes}")
        ctx = _context(state, request, endpoint, await read_limited(request, state.settings.max_body_bytes))
    except APIError as exc:
        state.metrics.requests.labels("client_error" if exc.status < 500 else "upstream_error", "none").inc()
        raise
    orch = Orchestrator(state)
    try:
        return await until_disconnect(request, _run(state, orch, ctx))
    except ClientGone:
        ctx.outcome = "cancelled"
        finish(state, ctx, None, None)
        return Response(status_code=499)
    except UpstreamReply as reply:
        ctx.outcome = "client_error"
        finish(state, ctx, None, None)
        return Response(content=reply.content, status_code=reply.status, media_type=reply.content_type,
                        headers=_route_headers(ctx))
    except APIError as exc:
        if ctx.outcome == "ok":
            ctx.outcome = "timeout" if exc.status == 504 else "upstream_error"
        ctx.error = exc.message
        finish(state, ctx, None, None)
        return error_response(exc.status, exc.message, exc.param, exc.type)
