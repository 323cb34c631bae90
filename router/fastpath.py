"""The hot path as a plain ASGI handler: POST /v1/completions and /v1/chat/completions.

For the app under any ASGI server (uvicorn, in-process test clients): `RouterApp` (router/app.py) hands
these two routes here before FastAPI's middleware, routing and dependency machinery (which stay for every
other route: admin, health, metrics). `pdcluster router` runs router/server.py instead, which calls the
same `service.serve` without ASGI. Per request this does
only: read the body (413 past `max_body_bytes`), pick the headers the router reads (READ_HEADERS), run
`service.serve`, write the reply (a body, or the relayed stream chunk by chunk).

A client that disconnects is noticed by one watcher (`receive()` answers `http.disconnect`), which cancels
the request's task: before the reply that aborts the legs in flight, during a stream it ends the relay
(both legs aborted, `cancelled`). Unexpected exceptions answer an OpenAI-style 500.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from router.service import Reply, error_reply, serve
from router.state import RouterState
from serving.errors import APIError, error_body

log = logging.getLogger("router")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
READ_HEADERS = (b"x-session-id", b"x-expected-context-tokens", b"content-length", b"authorization")


async def read_body(receive, max_bytes: int) -> bytes:
    """The request body, refused (413) as soon as it grows past `max_bytes`."""
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > max_bytes:
            raise APIError(413, f"request body is {len(body)} bytes, more than the limit of {max_bytes}")
        return body
    parts, size = [body], len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(499, "client closed the request while sending it")
        part = message.get("body", b"")
        size += len(part)
        if size > max_bytes:
            raise APIError(413, f"request body is more than the limit of {max_bytes} bytes")
        parts.append(part)
    return b"".join(parts)


def _response_start(reply: Reply) -> dict:
    headers = [(b"content-type", reply.content_type.encode())]
    headers += [(name.encode(), value.encode()) for name, value in reply.headers.items()]
    if reply.stream is None:
        headers.append((b"content-length", str(len(reply.body)).encode()))
    return {"type": "http.response.start", "status": reply.status, "headers": headers}


async def _write(reply: Reply, send) -> None:
    await send(_response_start(reply))
    if reply.stream is None:
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})
        return
    stream = reply.stream
    try:
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        await stream.aclose()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def handle(state: RouterState, endpoint: str, scope, receive, send) -> None:
    started = time.monotonic()
    headers = {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in READ_HEADERS}
    task = asyncio.current_task()
    is_gone = False
    is_replying = True

    def on_disconnect(watcher: asyncio.Future) -> None:
        nonlocal is_gone
        if is_replying and not watcher.cancelled() and watcher.exception() is None:
            is_gone = True
            task.cancel()

    watcher = None
    reply: Reply | None = None
    try:
        try:
            length = int(headers.get("content-length") or 0)
            if length > state.settings.max_body_bytes:
                raise APIError(413, f"request body is {length} bytes, more than the limit of "
                                    f"{state.settings.max_body_bytes}")
            raw = await read_body(receive, state.settings.max_body_bytes)
        except APIError as exc:
            state.metrics.requests.labels("client_error", "none").inc()
            reply = error_reply(exc.status, exc.message, exc.param, exc.type)
            await _write(reply, send)
            return
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(on_disconnect)
        reply = await serve(state, endpoint, headers, raw, started)
        await _write(reply, send)
        is_replying = False
        reply.sent()
    except asyncio.CancelledError:
        if not is_gone:
            raise
        task.uncancel()
        if reply is not None:
            reply.sent()
            if reply.on_abandon is not None:
                await reply.on_abandon()
    except Exception:  # noqa: BLE001 - the edge answers every failure as OpenAI JSON
        log.exception("router: unexpected error on %s", scope["path"])
        if reply is not None:
            reply.sent()
            if reply.on_abandon is not None:
                await reply.on_abandon()  # a stream that never started: its bookkeeping (admission slot) still runs
        else:
            body = orjson.dumps(error_body(500, "internal router error"))
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
    finally:
        is_replying = False
        if watcher is not None:
            watcher.cancel()
