"""The two legs of a PD request, per vLLM's protocol, with retries, breakers, timeouts and aborts.

P leg: `kvparams.prefill_body` to the best compatible prefill (same X-Request-Id as D), retried on the
next candidate after a failure or timeout (up to `prefill_max_attempts`); when every attempt fails the
fallback policy either sends D the plain request (D prefills locally) or answers 502/504.
D leg: `kvparams.decode_body` (P's handoff, never the client's kv_transfer_params). Non-streaming waits
for the whole answer; streaming returns once the first chunk arrived (within `first_token_timeout_s`),
and relay.py streams the rest. Both legs go through `state.upstream` (router/upstream.py); bodies are
serialised with orjson. `ctx.upstream_s` sums the wall time of every leg attempt (send to last byte), so
the router's own share of a request (`pdcluster_router_overhead_seconds`) is what is left.
Breakers: P failures count against P; D failures (5xx, timeouts, broken connections) against D and, when
a handoff was used, against the P-D link (a broken transfer path). A node's shedding (429, or 503 with
Retry-After) counts neither way: P is skipped for the next candidate, D's answer goes to the client with
its Retry-After. A decode instance that cannot be connected to (the request never reached it) is replaced
once by the least-loaded other usable, compatible decode of the pool before any byte reached the client (a
hand-off bound to the unreachable instance is given back at P and the new one prefills the prompt itself).
The P leg names the chosen decode instance's engine id as the hand-off's reader; one of our decode instances whose
id cannot be learned (router/readers.py) gets no P leg: it prefills the prompt itself.
A session that outgrew its pool sends its first P leg to the old pool's decode instance holding it
(`Placement.move_source`, router/placement.py): it exports the session's rows (`transfer_mode="move"`,
`pdcluster_migrations_total{reason="session_growth"}`); any refusal or failure there falls to the next prefill.
A cancelled leg (client gone) closes its connection and calls the engine's aborter on both legs so
neither node keeps rows for it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import orjson

from router.aborts import aborter_for
from router.admission import is_node_draining, is_node_shed
from router.breaker import Attempt
from router.kvparams import KVHandoff, decode_body, handoff_from_answer, prefill_body
from router.migration import Migration
from router.placement import Placement, RequestShape, load_score
from router.readers import UnknownReader
from router.registry import InstanceState, host_of
from router.session_routing import cached_tokens_of
from router.state import RouterState
from router.upstream import CONNECT_ERRORS, UPSTREAM_ERRORS, UpstreamResponse
from router.validation import ValidRequest
from serving.errors import APIError


@dataclass
class RequestContext:
    request_id: str
    path: str
    valid: ValidRequest
    shape: RequestShape
    placement: Placement
    started: float
    handoff: KVHandoff | None = None
    prefill_s: float | None = None
    upstream_s: float = 0.0
    """Wall time inside upstream legs: every P attempt and the D leg, send to last byte (the relay adds the
    streamed part)."""
    first_decode_s: float | None = None
    kv_transfer_s: float | None = None
    is_prefill_timeout: bool = False
    fallback_reason: str | None = None
    outcome: str = "ok"
    error: str | None = None
    """Why the request did not end `ok` (logged by service.finish)."""
    notes: list[str] = field(default_factory=list)
    is_admitted: bool = False
    """Holds a slot of its pool's admission cap until `service.finish` releases it."""
    prefill_cached_tokens: int | None = None
    """The P leg's usage cached_tokens (what the client sees when a P leg ran; router/session_routing.py)."""
    leg: str = "placement"
    """Where the request is (or failed): placement, prefill, decode, then stream once the relay runs."""
    instance: str = "none"
    """The instance of the leg in `leg` (the last one tried)."""
    stream_attempts: DecodeAttempts | None = None
    """A streamed D leg's breaker attempts, ended with the relay (service._StreamEnd)."""
    migration: Migration | None = None
    """Set when the request can resume on another decode instance (router/migration.py)."""

    @property
    def leg_request_id(self) -> str:
        """The X-Request-Id the legs carry (the request's own until it moved)."""
        return self.request_id if self.migration is None else self.migration.leg_request_id


@dataclass
class DecodeAttempts:
    """The D leg's breaker attempts: its decode instance and, when a handoff was used, the P-D link. Each ends
    once; `neutral` after an end does nothing."""

    instance: Attempt
    link: Attempt | None

    def succeeded(self) -> None:
        self.instance.succeeded()
        if self.link is not None:
            self.link.succeeded()

    def failed(self, now: float) -> None:
        self.instance.failed(now)
        if self.link is not None:
            self.link.failed(now)

    def neutral(self) -> None:
        self.instance.neutral()
        if self.link is not None:
            self.link.neutral()


def upstream_message(content: bytes, limit: int = 300) -> str:
    """': <message>' from a node's OpenAI-style error body (empty if there is none), for the router's own error."""
    try:
        message = orjson.loads(content)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    return f": {str(message)[:limit]}"


class UpstreamReply(Exception):
    """A node's own 4xx answer (or its shedding 503 with Retry-After), relayed to the client unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str | None, headers=None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type or "application/json"
        self.headers = {k: v for k, v in (headers or {}).items() if k.lower() == "retry-after"}


class DecodeFailed(APIError):
    """The decode leg failed on the node's side (`reason`: router/migration.py REASONS): the request may resume
    elsewhere."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(status, message)
        self.reason = reason


class DecodeUnreachable(Exception):
    """No connection to the decode instance could be opened (the request never reached it)."""


class Orchestrator:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.settings = state.settings

    def _headers(self, ctx: RequestContext) -> dict[str, str]:
        headers = {"X-Request-Id": ctx.leg_request_id}
        if ctx.shape.session_id:  # the hashed, tenant-scoped key (router/identity.py), never the client's id
            headers["x-pdcluster-session"] = ctx.shape.session_id
        if ctx.shape.cache_scope:  # the tenant's prefix-cache scope (a digest, never the key)
            headers["x-pdcluster-tenant"] = ctx.shape.cache_scope
        return headers

    def abort(self, state: InstanceState | None, request_id: str) -> None:
        """Fire-and-forget abort on one node (survives the cancellation of the request)."""
        if state is None:
            return
        engine = self.state.registry.view(state).geometry.engine
        self.state.spawn(aborter_for(engine).abort(self.state.client, state.spec.url, request_id))

    def abort_legs(self, ctx: RequestContext) -> None:
        reg = self.state.registry
        self.abort(reg.get(ctx.placement.decode), ctx.leg_request_id)
        if ctx.handoff is not None:
            self.abort(reg.get(ctx.handoff.prefill), ctx.leg_request_id)

    async def prefill(self, ctx: RequestContext) -> KVHandoff | None:
        """Run the P leg; None means 'D prefills locally' (fallback, nothing to hand off, or a decode instance of
        ours whose engine id is unknown: it is never sent an unbound hand-off, router/readers.py)."""
        try:
            reader = await self.state.readers.reader_for(ctx.placement.decode)
        except UnknownReader as exc:
            ctx.fallback_reason = f"{exc}: it prefills the prompt itself"
            return None
        num_attempts = 0
        for name in ctx.placement.prefills:
            if num_attempts >= self.settings.prefill_max_attempts:
                break
            now = time.monotonic()
            breakers = self.state.breakers
            state = self.state.registry.get(name)
            if state is None or not state.is_healthy or state.is_draining or not breakers.instance(name).allows(now) \
                    or not breakers.link(name, ctx.placement.decode).allows(now):
                continue
            if num_attempts:
                self.state.metrics.retries.labels("prefill").inc()
            num_attempts += 1
            handoff = await self._prefill_once(ctx, state, reader)
            if handoff is not None or ctx.fallback_reason == "no handoff":
                return handoff
        if self.settings.prefill_fallback == "decode_only":
            ctx.fallback_reason = ctx.fallback_reason or f"prefill failed after {num_attempts} attempt(s)"
            return None
        if ctx.is_prefill_timeout:
            raise APIError(504, f"prefill timed out after {num_attempts} attempt(s)")
        raise APIError(502, f"prefill failed after {num_attempts} attempt(s)")

    async def _prefill_once(self, ctx: RequestContext, state: InstanceState, reader: str | None) -> KVHandoff | None:
        name = state.spec.name
        attempt = self.state.breakers.instance(name).attempt(time.monotonic())
        ctx.leg, ctx.instance = "prefill", name
        try:
            return await self._prefill_attempt(ctx, state, attempt, reader)
        finally:
            attempt.neutral()  # a cancelled or broken leg that ended no other way (no-op once ended)

    async def _prefill_attempt(self, ctx: RequestContext, state: InstanceState, attempt: Attempt,
                               reader: str | None) -> KVHandoff | None:
        name, url = state.spec.name, state.spec.url
        state.num_inflight += 1
        started = time.monotonic()
        try:
            async with self.state.deadlines.within(self.settings.prefill_timeout_s):
                body = prefill_body(ctx.valid.body, reader=reader)
                resp, content = await self._post(url, ctx, orjson.dumps(body))
        except TimeoutError:
            self.state.metrics.leg_timeouts.labels("prefill").inc()
            ctx.is_prefill_timeout = True
            ctx.notes.append(f"{name}: timed out")
            attempt.failed(time.monotonic())
            self.abort(state, ctx.leg_request_id)
            return None
        except UPSTREAM_ERRORS as exc:
            ctx.notes.append(f"{name}: {type(exc).__name__}")
            attempt.failed(time.monotonic())
            return None
        except asyncio.CancelledError:
            self.abort(state, ctx.leg_request_id)
            raise
        finally:
            state.num_inflight -= 1
            ctx.upstream_s += time.monotonic() - started
        if is_node_shed(resp.status_code, resp.headers):
            ctx.notes.append(f"{name}: shed ({resp.status_code})")
            attempt.neutral()
            return None
        if resp.status_code >= 500:
            ctx.notes.append(f"{name}: HTTP {resp.status_code}")
            attempt.failed(time.monotonic())
            return None
        is_move = name == ctx.placement.move_source
        if resp.status_code >= 400 and is_move:  # the source cannot export (not the client's fault): the next one
            ctx.notes.append(f"{name}: cannot move the session's KV ({upstream_message(content)})")
            attempt.neutral()
            return None
        attempt.succeeded()
        if resp.status_code >= 400:
            raise UpstreamReply(resp.status_code, content, resp.headers.get("content-type"))
        ctx.prefill_s = time.monotonic() - started
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict):
            ctx.prefill_cached_tokens = cached_tokens_of(answer.get("usage"))
        handoff = handoff_from_answer(name, host_of(state.spec.url), answer)
        if handoff is None:
            ctx.fallback_reason = "no handoff"
        elif is_move:  # the session's kept KV moves decode-to-decode (router/placement.py `move_source`)
            self.state.metrics.migrations.labels("session_growth").inc()
        else:
            self.state.note_prefill_engine(name, handoff.remote_engine_id)
        return handoff

    def start_decode_attempts(self, ctx: RequestContext, name: str) -> DecodeAttempts:
        """The D leg's attempts: the decode instance's breaker and, with a handoff, the P-D link's."""
        now = time.monotonic()
        breakers = self.state.breakers
        link = breakers.link(ctx.handoff.prefill, name).attempt(now) if ctx.handoff is not None else None
        ctx.leg, ctx.instance = "decode", name
        return DecodeAttempts(breakers.instance(name).attempt(now), link)

    def record_decode_status(self, ctx: RequestContext, attempts: DecodeAttempts, status: int | None,
                             headers=None) -> None:
        """End the D leg's attempts and keep the warm pairs after D answered (`status` None: connection failed,
        timed out or the stream broke). A node's shedding (429, 503 with Retry-After) counts neither way."""
        if status is not None and is_node_shed(status, headers or {}):
            attempts.neutral()
            return
        ok = status is not None and status < 500
        attempts.succeeded() if ok else attempts.failed(time.monotonic())
        if ctx.handoff is not None:
            self.state.set_warm((ctx.handoff.prefill, ctx.placement.decode), ok)

    async def _post(self, url: str, ctx: RequestContext, body: bytes) -> tuple[UpstreamResponse, bytes]:
        """One whole leg: send, read the answer to its end (the connection goes back to the pool)."""
        resp = await self.state.upstream.send(url, ctx.path, body, self._headers(ctx))
        try:
            return resp, await resp.aread()
        finally:
            await resp.aclose()

    def move_decode(self, ctx: RequestContext) -> bool:
        """After a connect error: switch the request to the least-loaded other usable decode instance of its
        pool (compatible with its prefill's handoff); False when there is none."""
        now = time.monotonic()
        failed = ctx.placement.decode
        pairs = self.state.usable_pairs(now) | self.state.usable_move_pairs(now)
        blocked = self.state.blocked_instances(now)
        handoff = ctx.handoff if ctx.handoff is not None and not ctx.handoff.is_bound else None
        candidates = [v for v in self.state.registry.snapshot()
                      if v.role == "decode" and v.pool == ctx.placement.pool and v.is_usable and v.name != failed
                      and v.name not in blocked and (handoff is None or (handoff.prefill, v.name) in pairs)]
        if not candidates:
            return False
        if ctx.handoff is not None and handoff is None:
            # Bound to the unreachable reader, which never claimed it: no other decode node may redeem it, so
            # its lease is given back and the new instance prefills the prompt itself.
            self.abort(self.state.registry.get(ctx.handoff.prefill), ctx.leg_request_id)
            ctx.handoff, ctx.prefill_cached_tokens = None, None
            ctx.fallback_reason = f"the hand-off was bound to {failed}"
        best = min(candidates, key=lambda v: (load_score(v), v.name))
        ctx.placement = replace(ctx.placement, decode=best.name,
                                reason=f"{ctx.placement.reason}; {failed} unreachable, retried on {best.name}")
        self.state.metrics.retries.labels("decode").inc()
        return True

    async def with_decode_retry(self, ctx: RequestContext, leg):
        """Run `leg(ctx)`; a connect error to the decode instance is retried once on another one."""
        try:
            return await leg(ctx)
        except DecodeUnreachable as exc:
            if not self.move_decode(ctx):
                raise DecodeFailed(502, f"decode instance {ctx.placement.decode} failed: {exc}",
                                   "unreachable") from None
        try:
            return await leg(ctx)
        except DecodeUnreachable as exc:
            raise DecodeFailed(502, f"decode instance {ctx.placement.decode} failed: {exc}", "unreachable") from None

    async def decode_json(self, ctx: RequestContext) -> tuple[UpstreamResponse, bytes]:
        """The D leg of a non-streaming request: (response, body)."""
        return await self.with_decode_retry(ctx, self._decode_json_once)

    async def _decode_json_once(self, ctx: RequestContext) -> tuple[UpstreamResponse, bytes]:
        state = self._decode_state(ctx)
        attempts = self.start_decode_attempts(ctx, state.spec.name)
        try:
            return await self._decode_json_attempt(ctx, state, attempts)
        finally:
            attempts.neutral()  # a cancelled leg (no-op once ended)

    async def _decode_json_attempt(self, ctx: RequestContext, state: InstanceState,
                                   attempts: DecodeAttempts) -> tuple[UpstreamResponse, bytes]:
        body = orjson.dumps(decode_body(ctx.valid.body, ctx.handoff))
        state.num_inflight += 1
        started = time.monotonic()
        try:
            async with self.state.deadlines.within(self.settings.decode_timeout_s):
                resp, content = await self._post(state.spec.url, ctx, body)
        except TimeoutError:
            self.state.metrics.leg_timeouts.labels("decode").inc()
            self.record_decode_status(ctx, attempts, None)
            ctx.outcome = "timeout"
            self.abort_legs(ctx)
            raise DecodeFailed(504, f"decode timed out after {self.settings.decode_timeout_s} s", "timeout") from None
        except CONNECT_ERRORS as exc:
            self.record_decode_status(ctx, attempts, None)
            raise DecodeUnreachable(type(exc).__name__) from None
        except UPSTREAM_ERRORS as exc:
            self.record_decode_status(ctx, attempts, None)
            ctx.outcome = "upstream_error"
            raise DecodeFailed(502, f"decode instance {state.spec.name} failed: {type(exc).__name__}",
                               "stream_broke") from None
        except asyncio.CancelledError:
            self.abort_legs(ctx)
            raise
        finally:
            state.num_inflight -= 1
            ctx.upstream_s += time.monotonic() - started
        self.record_decode_status(ctx, attempts, resp.status_code, resp.headers)
        if is_node_shed(resp.status_code, resp.headers):
            self.abort_legs(ctx)  # the prefill's rows go back now, not when its lease expires
        self._note_kv_time(ctx, resp)
        return resp, content

    def _decode_state(self, ctx: RequestContext) -> InstanceState:
        ctx.leg, ctx.instance = "decode", ctx.placement.decode
        state = self.state.registry.get(ctx.placement.decode)
        if state is None:
            raise APIError(503, f"decode instance {ctx.placement.decode} left the registry")
        return state

    def _note_kv_time(self, ctx: RequestContext, resp: UpstreamResponse) -> None:
        """Decode nodes may report the KV fetch time (header X-KV-Transfer-Seconds)."""
        value = resp.headers.get("x-kv-transfer-seconds")
        try:
            ctx.kv_transfer_s = float(value) if value is not None else None
        except ValueError:
            ctx.kv_transfer_s = None

    async def open_stream(self, ctx: RequestContext) -> tuple[UpstreamResponse, object, bytes]:
        """Send the D leg and wait for its first chunk; returns (response, raw iterator, first chunk)."""
        return await self.with_decode_retry(ctx, self._open_stream_once)

    async def _open_stream_once(self, ctx: RequestContext) -> tuple[UpstreamResponse, object, bytes]:
        state = self._decode_state(ctx)
        attempts = self.start_decode_attempts(ctx, state.spec.name)
        try:
            opened = await self._open_stream_attempt(ctx, state, attempts)
        except BaseException:
            attempts.neutral()  # a cancelled leg (no-op once ended)
            raise
        ctx.stream_attempts = attempts  # ended by the relay's end (service._StreamEnd)
        return opened

    async def _open_stream_attempt(self, ctx: RequestContext, state: InstanceState,
                                   attempts: DecodeAttempts) -> tuple[UpstreamResponse, object, bytes]:
        body = orjson.dumps(decode_body(ctx.valid.body, ctx.handoff))
        started = time.monotonic()
        state.num_inflight += 1
        resp: UpstreamResponse | None = None
        try:
            async with self.state.deadlines.within(self.settings.first_token_timeout_s):
                resp = await self.state.upstream.send(state.spec.url, ctx.path, body, self._headers(ctx))
                if resp.status_code != 200:
                    content = await resp.aread()
                    await resp.aclose()
                    state.num_inflight -= 1
                    self.record_decode_status(ctx, attempts, resp.status_code, resp.headers)
                    if ctx.migration is not None and is_node_draining(resp.status_code, resp.headers):
                        raise DecodeFailed(503, f"decode instance {state.spec.name} is draining", "error_status")
                    if is_node_shed(resp.status_code, resp.headers):
                        self.abort_legs(ctx)
                        raise UpstreamReply(resp.status_code, content, resp.headers.get("content-type"),
                                            resp.headers)
                    if resp.status_code >= 500:
                        ctx.outcome = "upstream_error"
                        raise DecodeFailed(502, f"decode instance {state.spec.name} answered {resp.status_code}"
                                                f"{upstream_message(content)}", "error_status")
                    raise UpstreamReply(resp.status_code, content, resp.headers.get("content-type"))
                chunks = resp.aiter_raw()
                first = await anext(chunks)
        except TimeoutError:
            await self._close_failed(resp, state, ctx)
            self.record_decode_status(ctx, attempts, None)
            self.state.metrics.leg_timeouts.labels("first_decode").inc()
            ctx.outcome = "timeout"
            raise DecodeFailed(504, f"no first token within {self.settings.first_token_timeout_s} s",
                               "timeout") from None
        except CONNECT_ERRORS as exc:
            state.num_inflight -= 1  # nothing reached the node: no abort, the handoff stays valid for a retry
            self.record_decode_status(ctx, attempts, None)
            raise DecodeUnreachable(type(exc).__name__) from None
        except (*UPSTREAM_ERRORS, StopAsyncIteration) as exc:
            await self._close_failed(resp, state, ctx)
            self.record_decode_status(ctx, attempts, None)
            ctx.outcome = "upstream_error"
            raise DecodeFailed(502, f"decode instance {state.spec.name} failed: {type(exc).__name__}",
                               "stream_broke") from None
        except asyncio.CancelledError:
            await self._close_failed(resp, state, ctx)
            raise
        ctx.first_decode_s = time.monotonic() - started
        ctx.upstream_s += ctx.first_decode_s
        self._note_kv_time(ctx, resp)
        return resp, chunks, first

    async def _close_failed(self, resp: UpstreamResponse | None, state: InstanceState, ctx: RequestContext) -> None:
        if resp is not None:
            await resp.aclose()
        if resp is None or resp.status_code == 200:
            state.num_inflight -= 1
        self.abort_legs(ctx)
