"""One client request end to end: validate, place, run the legs, build the reply, account.

`serve()` is what the router's HTTP server (router/server.py) calls with the request's headers and body; it
returns a `Reply` (status, headers, a body or a relay stream) and never touches the HTTP server. A client
that leaves cancels the task running `serve()` (before the reply) or the relay (after): the legs' cleanup
aborts both legs and the request is counted `cancelled`. `finish()` fills the metrics, including the
router's own time outside the upstream legs, and keeps the session table current.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace

import orjson

from router.admission import PoolFull, is_node_draining, is_node_shed
from router.identity import cache_scope
from router.placement import NoPlacement, Placement, RequestShape, SessionRecord, place
from router.session_routing import after_turn, expected_growth, identify, prompt_estimate, rewrite_usage, \
    with_cached_tokens
from router.migration import start as start_migration
from router.moves import Mover, StreamResume
from router.proxy import DecodeFailed, Orchestrator, RequestContext, UpstreamReply, upstream_message
from router.relay import StreamAccounting, relay
from router.state import RouterState
from router.validation import Endpoint, parse_body, validate
from serving.errors import APIError, error_body, scrub_error_content

log = logging.getLogger("router")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
JSON = "application/json"


@dataclass
class Reply:
    """What the HTTP edge sends: a whole body, or `stream` (an async iterator of bytes) when set."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    content_type: str = JSON
    stream: AsyncIterator[bytes] | None = None
    on_abandon: object = None
    """For streams: called when the client left before the stream was iterated (runs the bookkeeping)."""
    on_sent: object = None
    """For whole bodies: the bookkeeping, run once after the body was handed to the client (or the client
    left), so metrics and session updates are not on the client's path."""

    def sent(self) -> None:
        """Run `on_sent` once."""
        callback, self.on_sent = self.on_sent, None
        if callback is not None:
            callback()


def error_reply(status: int, message: str, param: str | None = None, type_: str | None = None) -> Reply:
    return Reply(status, body=orjson.dumps(error_body(status, message, param, type_)))


OUTCOME_REASONS = {"cancelled": "the client left", "shed": "the node shed it (busy, Retry-After)"}


def log_failure(request_id: str, outcome: str, leg: str, instance: str, pool: str, elapsed_s: float,
                reason: str) -> None:
    """The one log line of a request that did not end `ok`: WARNING, or INFO for the client's own error (a bad
    request is not the router failing). `leg`: admission, placement, prefill or decode; `instance`: that leg's."""
    level = logging.INFO if outcome == "client_error" else logging.WARNING
    log.log(level, "request %s %s: leg %s, instance %s, pool %s, after %.2f s: %s", request_id, outcome, leg,
            instance, pool, elapsed_s, reason)


def _shape(state: RouterState, headers: Mapping[str, str], body: dict, session_key: str | None,
           scope: str = "") -> RequestShape:
    s = state.settings
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or s.default_max_tokens
    return RequestShape(session_id=session_key, prompt_tokens=prompt_estimate(state, body),
                        max_tokens=int(max_tokens),
                        expected_growth_tokens=expected_growth(headers, s.session_growth_tokens), cache_scope=scope)


def place_request(state: RouterState, shape: RequestShape, now: float, scores_prompt: bool = False) -> Placement:
    """Place one validated request at `now` (monotonic seconds): the session's record, a registry snapshot and
    the cache view into `place`; a slot of the pool's admission taken (PoolFull: shed before any node or session
    is touched); the session's record written. No I/O: the cluster simulator (sim/) calls it with its own clock.
    503 (APIError) when no decode instance can take it."""
    s = state.settings
    session = state.sessions.get(shape.session_id, now) if shape.session_id else None
    instances = state.registry.snapshot()
    try:
        placement = place(shape, session, state.pool_views(instances), instances, state.usable_pairs(now),
                          state.warm_pairs, s.disagg_min_uncached_tokens,
                          hash_sessions=state.is_multi_worker, blocked=state.blocked_instances(now),
                          held=state.cache_view.held(shape.session_id),
                          resumable=state.cache_view.resumable(shape.session_id),
                          move_pairs=state.usable_move_pairs(now))
    except NoPlacement as exc:
        raise APIError(503, f"no decode instance available: {exc}") from None
    if scores_prompt and placement.disaggregate:  # prompt log-probs come from the prompt's own prefill
        placement = replace(placement, disaggregate=False, move_source=None,
                            reason=f"{placement.reason}; colocated: scores the prompt")
    state.admission.enter(placement.pool)
    if shape.session_id:
        known_tokens = max(shape.prompt_tokens, session.context_tokens if session else 0)
        state.sessions.put(SessionRecord(shape.session_id, placement.pool, placement.decode, known_tokens, now))
    return placement


def _context(state: RouterState, headers: Mapping[str, str], endpoint: Endpoint, raw: bytes,
             started: float, request_id: str) -> RequestContext:
    s = state.settings
    scope = cache_scope(state.api_keys.tenant(headers.get("authorization")))  # 401 before the body is parsed
    body = parse_body(raw, s.max_body_bytes)
    session_key = identify(state, headers, body)  # 400 for an oversized session id, whatever else is wrong
    valid = validate(body, endpoint, state.registry.known_model_ids(), s.max_tokens_limit)
    if valid.body["model"] not in state.registry.served_model_ids():
        raise NoHealthyInstance(valid.body["model"])
    shape = _shape(state, headers, valid.body, session_key, scope)
    placement = place_request(state, shape, time.monotonic(), valid.scores_prompt)
    decode = state.registry.get(placement.decode)
    engine = state.registry.view(decode).geometry.engine if decode is not None else None
    migration = start_migration(request_id, valid.body, engine, s.migration_limit, s.migration_timeout_s,
                                valid.is_stream)
    return RequestContext(request_id=request_id, path=PATHS[endpoint], valid=valid, shape=shape,
                          placement=placement, started=started, is_admitted=True, migration=migration)


def _route_headers(ctx: RequestContext) -> dict[str, str]:
    headers = {"x-request-id": ctx.request_id, "x-pdcluster-pool": ctx.placement.pool,
               "x-pdcluster-decode": ctx.placement.decode,
               "x-pdcluster-prefill": ctx.handoff.prefill if ctx.handoff else "none"}
    if ctx.placement.is_migration:
        headers["x-pdcluster-migrated"] = "true"
    return headers


def finish(state: RouterState, ctx: RequestContext, acct: StreamAccounting | None, usage: dict | None) -> None:
    """Metrics and session bookkeeping once a request ended (any outcome)."""
    m, pool, model = state.metrics, ctx.placement.pool, ctx.valid.model
    now = time.monotonic()
    if ctx.is_admitted:
        ctx.is_admitted = False
        state.admission.leave(pool)
    m.child(m.requests, ctx.outcome, pool).inc()
    if ctx.outcome != "ok":
        reason = ctx.error or OUTCOME_REASONS.get(ctx.outcome, ctx.outcome)
        if ctx.notes:
            reason = f"{reason} (tried: {', '.join(ctx.notes)})"
        log_failure(ctx.request_id, ctx.outcome, ctx.leg, ctx.instance, pool, now - ctx.started, reason)
    if ctx.prefill_s is not None:
        m.child(m.leg, "prefill", pool).observe(ctx.prefill_s)
    if ctx.kv_transfer_s is not None:
        m.child(m.leg, "kv_transfer", pool).observe(ctx.kv_transfer_s)
    if ctx.first_decode_s is not None:
        m.child(m.leg, "first_decode", pool).observe(ctx.first_decode_s)
    if ctx.outcome != "ok":
        return
    e2e = now - ctx.started
    m.child(m.e2e, pool, model).observe(e2e)
    m.child(m.overhead, pool).observe(max(0.0, e2e - ctx.upstream_s))
    if acct is not None and acct.ttft_s is not None:
        m.child(m.ttft, pool, model).observe(acct.ttft_s)
        itl = m.child(m.itl, pool, model)
        for gap, num in acct.itl_counts():
            itl.observe_many(gap, num)
        num_out = (usage or {}).get("completion_tokens") or acct.num_token_events
        if num_out > 1:
            m.child(m.tpot, pool, model).observe((e2e - acct.ttft_s) / (num_out - 1))
    if ctx.shape.session_id and usage:
        total = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        state.sessions.put(SessionRecord(ctx.shape.session_id, pool, ctx.placement.decode, total, now))
    after_turn(state, ctx, usage, now)


def _shed_headers(ctx: RequestContext, headers) -> dict[str, str]:
    """Route headers plus the node's Retry-After (a shed answer keeps it)."""
    out = _route_headers(ctx)
    if "retry-after" in headers:
        out["retry-after"] = headers["retry-after"]
    return out


def _usage(ctx: RequestContext, status: int, content: bytes) -> dict | None:
    """The answer's usage (the session's context size, the prompt and cached-token counters)."""
    if status != 200:
        return None
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None


class _StreamEnd:
    """Runs the end-of-stream bookkeeping exactly once (relay's finally, or `abandon` when the client left
    before the relay started)."""

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
        self.ctx.upstream_s += (self.acct.ended_at or time.monotonic()) - self.acct.started_relay
        self.ctx.outcome = status
        if status != "ok":
            self.orch.abort_legs(self.ctx)
        attempts = self.ctx.stream_attempts
        assert attempts is not None, "open_stream hands the stream's attempts over"
        if status == "ok":  # a clean end ([DONE], no error event) is a success of the instance and the link
            self.orch.record_decode_status(self.ctx, attempts, 200)
        elif status == "upstream_error":
            self.ctx.error = self.acct.error or "decode stream ended without [DONE] or broke"
            self.orch.record_decode_status(self.ctx, attempts, None)
        elif status == "timeout":
            self.ctx.error = f"decode stream idle for more than {self.state.settings.stream_idle_timeout_s} s"
            self.state.metrics.leg_timeouts.labels("decode").inc()
            self.orch.record_decode_status(self.ctx, attempts, None)
        else:  # the client left: says nothing about the node
            attempts.neutral()
        finish(self.state, self.ctx, self.acct, self.acct.usage)

    async def abandon(self) -> None:
        if not self.is_done:
            await self.resp.aclose()
            self("cancelled")


async def _run(state: RouterState, orch: Orchestrator, ctx: RequestContext) -> Reply:
    """The request's legs; a decode failure moves a resumable request to another instance (router/moves.py)."""
    mover = Mover(state, orch, ctx) if ctx.migration is not None else None
    while True:
        try:
            return await _attempt(state, orch, ctx, mover)
        except DecodeFailed as exc:
            if mover is None:
                raise
            mover.move(exc.reason)  # nothing reached the client yet: the whole request runs again


async def _attempt(state: RouterState, orch: Orchestrator, ctx: RequestContext, mover: Mover | None) -> Reply:
    if ctx.placement.disaggregate:
        ctx.handoff = await orch.prefill(ctx)
    if not ctx.valid.is_stream:
        resp, content = await orch.decode_json(ctx)
        headers = _route_headers(ctx)
        if mover is not None and resp.status_code >= 500 and (not is_node_shed(resp.status_code, resp.headers)
                                                              or is_node_draining(resp.status_code, resp.headers)):
            raise DecodeFailed(502, f"decode answered {resp.status_code}{upstream_message(content)}", "error_status")
        if is_node_shed(resp.status_code, resp.headers):
            ctx.outcome, headers = "shed", _shed_headers(ctx, resp.headers)
            ctx.error = f"decode shed it ({resp.status_code})"
        elif resp.status_code != 200:
            ctx.outcome = "client_error" if resp.status_code < 500 else "upstream_error"
            ctx.error = f"decode answered {resp.status_code}{upstream_message(content)}"
        elif ctx.handoff is not None or mover is not None:  # the P leg's figure, at most the prompt (session_routing)
            content = rewrite_usage(content, ctx.prefill_cached_tokens if ctx.handoff is not None else None)
        return Reply(resp.status_code, headers, content, resp.headers.get("content-type", JSON),
                     on_sent=lambda: finish(state, ctx, None, _usage(ctx, resp.status_code, content)))
    resp, chunks, first = await orch.open_stream(ctx)
    acct = StreamAccounting(ctx.started, started_relay=time.monotonic(), tracks_ids=mover is not None)
    end = _StreamEnd(state, orch, ctx, acct, resp)
    resume = StreamResume(mover, acct) if mover is not None else None
    stream = relay(resp, chunks, first, acct, state.settings.stream_idle_timeout_s, end, resume)
    if ctx.handoff is not None or mover is not None:  # the last placement's figure (router/session_routing.py)
        stream = with_cached_tokens(stream, lambda: ctx.prefill_cached_tokens if ctx.handoff is not None else None)
    return Reply(200, _route_headers(ctx), content_type="text/event-stream", stream=stream,
                 on_abandon=end.abandon)


class NoHealthyInstance(Exception):
    """The model is one the cluster serves, but no decode instance serving it is healthy now."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


async def serve(state: RouterState, endpoint: Endpoint, headers: Mapping[str, str], raw: bytes,
                started: float) -> Reply:
    """Handle one /v1/completions or /v1/chat/completions request (`headers`: lower-cased names). Error answers
    relayed from a node (a body, or an error event in a stream) reach the client scrubbed of internal names."""
    reply = await _serve(state, endpoint, headers, raw, started)
    if reply.stream is None:
        reply.body = scrub_error_content(reply.status, reply.body)
    return reply  # a stream is the relay's, which scrubs its error events itself


async def _serve(state: RouterState, endpoint: Endpoint, headers: Mapping[str, str], raw: bytes,
                 started: float) -> Reply:
    # Always the router's own id, random (router/state.py): a client-chosen or guessable one could collide with
    # (and abort) another request.
    request_id = state.next_request_id()
    try:
        ctx = _context(state, headers, endpoint, raw, started, request_id)
    except PoolFull as exc:
        state.metrics.child(state.metrics.requests, "shed", exc.pool).inc()
        message = f"too many requests in flight for pool {exc.pool}; retry later"
        log_failure(request_id, "shed", "admission", "none", exc.pool, time.monotonic() - started, message)
        reply = error_reply(429, message, type_="rate_limit_error")
        reply.headers.update({"retry-after": str(state.admission.retry_after_s), "x-request-id": request_id})
        return reply
    except NoHealthyInstance as exc:
        state.metrics.requests.labels("upstream_error", "none").inc()
        message = f"no healthy decode instance serves model {exc.model!r} right now; retry later"
        log_failure(request_id, "upstream_error", "placement", "none", "none", time.monotonic() - started, message)
        reply = error_reply(503, message, "model", "service_unavailable")
        reply.headers.update({"retry-after": str(state.admission.retry_after_s), "x-request-id": request_id})
        return reply
    except APIError as exc:
        outcome = "client_error" if exc.status < 500 else "upstream_error"
        state.metrics.requests.labels(outcome, "none").inc()
        log_failure(request_id, outcome, "placement", "none", "none", time.monotonic() - started,
                    f"{exc.status}: {exc.message}")
        reply = error_reply(exc.status, exc.message, exc.param, exc.type)
        reply.headers["x-request-id"] = request_id
        return reply
    except Exception:
        log_failure(request_id, "upstream_error", "placement", "none", "none", time.monotonic() - started,
                    "unexpected router error (traceback logged)")
        raise
    orch = Orchestrator(state)
    try:
        return await _run(state, orch, ctx)
    except asyncio.CancelledError:
        ctx.outcome = "cancelled"
        finish(state, ctx, None, None)
        raise
    except UpstreamReply as reply:
        is_shed = is_node_shed(reply.status, reply.headers)
        ctx.outcome = "shed" if is_shed else "client_error"
        ctx.error = f"{ctx.leg} answered {reply.status}{upstream_message(reply.content)}"
        finish(state, ctx, None, None)
        headers = _shed_headers(ctx, reply.headers) if is_shed else _route_headers(ctx)
        return Reply(reply.status, headers, reply.content, reply.content_type)
    except APIError as exc:
        if ctx.outcome == "ok":
            ctx.outcome = "timeout" if exc.status == 504 else "upstream_error"
        ctx.error = exc.message
        finish(state, ctx, None, None)
        reply = error_reply(exc.status, exc.message, exc.param, exc.type)
        reply.headers.update(_route_headers(ctx))
        return reply
    except Exception:
        ctx.outcome, ctx.error = "upstream_error", "unexpected router error (traceback logged)"
        finish(state, ctx, None, None)
        raise
