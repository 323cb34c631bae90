"""The router's HTTP/1.1 server (asyncio + httptools): the one way the router's app is served, by
`pdcluster router` (router/workers.py) and by the tests.

Why not a kept server (uvicorn, granian): in benchmarks/router.py they spend 1.3-1.5x this server's CPU per
request serving the same app at 64 connections (benchmarks/RESULTS.md, 2026-12-05). Here:
- POST /v1/completions and /v1/chat/completions go straight to `service.serve` (no ASGI scope); a reply is one
  `write` (head and body), a stream is its head, then each relayed chunk (chunked encoding), pausing while the
  client's socket is full.
- Every other route (health, metrics, models, admin) goes to the FastAPI app, buffered (router/asgi_bridge.py);
  `HEAD` is answered as `GET` without the body.
- Receiving (router/connection.py): keep-alive and pipelining, `Expect: 100-continue`, upgrades, the limits
  and timeouts. A client that disconnects cancels its request's task at once: before the reply that aborts
  the legs in flight; during a stream it ends the relay (both legs aborted, `cancelled`).
- One catch-all (`dispatch`): an unexpected exception anywhere on a request's path is logged with its
  traceback and answered as a scrubbed OpenAI error (500) while nothing of the answer was written; the
  connection is then closed. (The FastAPI routes' own errors are answered inside the app, serving/errors.py.)
- Every 503 carries Retry-After (`shed_retry_after_s` unless the answer names its own, as a node's shedding does).
- SIGTERM/SIGINT stop accepting and give requests in flight up to `GRACEFUL_S` to finish.
The app's lifespan (registry, health checks, upstream pool) runs around the server.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.asgi_bridge import call_asgi
from router.connection import Connection, Request
from router.service import Reply, error_reply, serve

log = logging.getLogger("router")
ENDPOINTS = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
READ_HEADERS = (b"x-session-id", b"x-expected-context-tokens", b"content-length", b"authorization")
"""The request headers `service.serve` reads."""
SWEEP_S = 1.0
"""How often idle, slow-sending and stalled-reading connections are looked for."""
GRACEFUL_S = 30.0
"""On SIGTERM, how long requests in flight may run before they are cancelled."""
STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
DROPPED_HEADERS = (b"content-length", b"transfer-encoding", b"connection")
"""Framing headers of an ASGI answer, which this server sets itself."""


def status_line(code: int) -> bytes:
    return STATUS.get(code) or f"HTTP/1.1 {code} Status {code}\r\n".encode()


class RouterServer:
    """Answers parsed requests: refusals, the completion routes (`service.serve`), the rest (the FastAPI app)."""

    def __init__(self, app) -> None:
        self.app = app
        self.limits = app.state.router.settings
        self.connections: set[Connection] = set()
        self._date = (0, b"")
        self.retry_after = b"retry-after: %d\r\n" % self.limits.shed_retry_after_s
        """Added to every 503 that names no Retry-After of its own (the router's and relayed ones alike)."""

    def date_header(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, f"date: {email.utils.formatdate(now, usegmt=True)}\r\n".encode())
        return self._date[1]

    def head(self, reply: Reply, is_keep_alive: bool, content_length: int | None) -> bytes:
        parts = [status_line(reply.status), b"content-type: ", reply.content_type.encode(), b"\r\n",
                 self.date_header()]
        for name, value in reply.headers.items():
            parts += [name.encode(), b": ", value.encode("latin-1"), b"\r\n"]
        if reply.status == 503 and "retry-after" not in reply.headers:
            parts.append(self.retry_after)
        if content_length is None:
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            parts += [b"content-length: ", str(content_length).encode(), b"\r\n"]
        if not is_keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def dispatch(self, conn: Connection, request: Request) -> None:
        """Answer one request; the one place an unexpected exception is caught."""
        conn.is_answering = False
        path, _, query = request.url.partition(b"?")
        endpoint = ENDPOINTS.get(path)
        try:
            if request.refusal is not None:
                if endpoint is not None:
                    self.app.state.router.metrics.requests.labels("client_error", "none").inc()
                self.write_whole(conn, request, request.refusal)
            elif endpoint is not None and request.method == b"POST":
                await self.completion(conn, request, endpoint)
            else:
                await self.asgi(conn, request, path, query)
        except asyncio.CancelledError:
            if not conn.is_closed:
                raise
            asyncio.current_task().uncancel()  # the client left: nothing to answer
        except Exception:  # noqa: BLE001 - the catch-all: every failure is OpenAI JSON, the traceback only logged
            log.exception("router: unexpected error on %s %s", request.method.decode("latin-1"),
                          path.decode("latin-1")[:200])
            if not conn.is_answering:
                failed = error_reply(500, "internal router error")
                conn.write(self.head(failed, False, len(failed.body)) + (b"" if request.method == b"HEAD" else failed.body))
            conn.close()

    def write_whole(self, conn: Connection, request: Request, reply: Reply) -> None:
        head = self.head(reply, request.is_keep_alive, len(reply.body))
        conn.write(head if request.method == b"HEAD" else head + reply.body)

    async def completion(self, conn: Connection, request: Request, endpoint: str) -> None:
        headers = {name.decode(): value.decode("latin-1") for name, value in request.headers if name in READ_HEADERS}
        reply = await serve(self.app.state.router, endpoint, headers, request.body, request.started)
        is_written = False
        try:
            await self.write_reply(conn, reply, request.is_keep_alive)
            is_written = True
        finally:
            reply.sent()
            if not is_written and reply.on_abandon is not None:
                await reply.on_abandon()  # a stream that never started: its bookkeeping (admission slot) still runs

    async def write_reply(self, conn: Connection, reply: Reply, is_keep_alive: bool) -> None:
        if reply.stream is None:
            conn.write(self.head(reply, is_keep_alive, len(reply.body)) + reply.body)
            return
        conn.write(self.head(reply, is_keep_alive, None))
        stream = reply.stream
        try:
            async for chunk in stream:
                if chunk:
                    conn.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if conn.is_write_paused:
                    await conn.drain()
        finally:
            await stream.aclose()
        conn.write(b"0\r\n\r\n")

    async def asgi(self, conn: Connection, request: Request, path: bytes, query: bytes) -> None:
        """A route of the FastAPI app (router/asgi_bridge.py); `HEAD` runs as `GET` and drops the body."""
        is_head = request.method == b"HEAD"
        sock = conn.transport.get_extra_info("sockname") or ("", 0)
        peer = conn.transport.get_extra_info("peername") or ("", 0)
        status, headers, body = await call_asgi(self.app, b"GET" if is_head else request.method, path, query,
                                                request.headers, request.body, tuple(peer[:2]), tuple(sock[:2]))
        parts = [status_line(status), self.date_header()]
        parts += [b"%s: %s\r\n" % (name, value) for name, value in headers if name.lower() not in DROPPED_HEADERS]
        if status == 503 and not any(name.lower() == b"retry-after" for name, _ in headers):
            parts.append(self.retry_after)
        parts.append(b"content-length: %d\r\n" % len(body))
        if not request.is_keep_alive:
            parts.append(b"connection: close\r\n")
        conn.write(b"".join(parts) + b"\r\n" + (b"" if is_head else body))

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.enforce_timeouts(now)


@asynccontextmanager
async def serving(app, graceful_s: float = GRACEFUL_S) -> AsyncIterator[RouterServer]:
    """The app's lifespan (router/app.py `create_app`) around a `RouterServer` and its sweep; on exit, requests in
    flight get up to `graceful_s` to finish before their connections are closed."""
    async with app.router.lifespan_context(app):
        server = RouterServer(app)
        sweeper = asyncio.create_task(server.sweep())
        try:
            yield server
        finally:
            sweeper.cancel()
            loop = asyncio.get_running_loop()
            for conn in [c for c in server.connections if c.task is None]:
                conn.close()
            deadline = loop.time() + graceful_s
            while any(c.task is not None for c in server.connections) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            for conn in list(server.connections):
                conn.close()


async def run_server(app, host: str, port: int, sock: socket.socket | None = None, *,
                     stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> None:
    """Serve `app` on `host:port` (or `sock`) until SIGTERM/SIGINT, or, when given, until `stop` is set (then no
    signal handlers are installed, as in a test thread). `ready` is set once listening."""
    handle_signals = stop is None
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    async with serving(app) as server:
        if sock is None:
            listener = await loop.create_server(lambda: Connection(server), host, port, backlog=2048,
                                                reuse_address=True)
        else:
            listener = await loop.create_server(lambda: Connection(server), sock=sock, backlog=2048)
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        listener.close()
