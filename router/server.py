"""The router's own HTTP/1.1 server (asyncio + httptools): what `pdcluster router` runs.

Why not uvicorn in front of the hot path: per request it builds an ASGI scope, checks every response
header against regexes, writes the head and the body in two syscalls, and a client that leaves is only
seen by a task parked in `receive()`. Here:
- POST /v1/completions and /v1/chat/completions go straight to `service.serve` (one task per request);
  a reply is one `write` (head and body), a stream is its head, then each relayed chunk (chunked).
- A client that disconnects cancels its request's task at once (`connection_lost`): before the reply
  that aborts the legs in flight; during a stream it ends the relay (both legs aborted, `cancelled`).
- Every other route (health, metrics, models, admin) goes to the FastAPI app (router/asgi_bridge.py).
- Keep-alive with pipelined requests answered in order, `Expect: 100-continue`, bodies past
  `max_body_bytes` refused (413) without buffering them, write back-pressure (a slow client pauses its
  relay); SIGTERM/SIGINT stop accepting and give requests in flight up to `GRACEFUL_S` to finish.
- Limits (router/settings.py): request line + headers past `max_header_bytes` get 431; a request not
  received completely within `body_read_timeout_s` of its first byte gets 408 (slow senders); a client
  that takes nothing of its reply for `write_timeout_s` (a stalled SSE reader) is disconnected, which
  cancels its request like any disconnect; keep-alive connections idle for `keep_alive_s` are closed;
  past `max_connections` per worker a new connection gets 503 and is closed. One sweep per
  `SWEEP_S` enforces the three timeouts (nothing per request or per chunk).
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
from collections import deque

import httptools

from router.asgi_bridge import call_asgi
from router.fastpath import ENDPOINTS, READ_HEADERS
from router.service import Reply, error_reply, serve

log = logging.getLogger("router")
SWEEP_S = 1.0
"""How often idle, slow-sending and stalled-reading connections are looked for."""
GRACEFUL_S = 30.0
"""On SIGTERM, how long requests in flight may run before they are cancelled."""
STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}


def status_line(code: int) -> bytes:
    return STATUS.get(code) or f"HTTP/1.1 {code} Status {code}\r\n".encode()


class Request:
    __slots__ = ("method", "url", "headers", "body", "is_keep_alive", "is_too_large", "started")

    def __init__(self, method: bytes, url: bytes, headers: list, body: bytes, is_keep_alive: bool,
                 is_too_large: bool, started: float) -> None:
        self.method, self.url, self.headers, self.body = method, url, headers, body
        self.is_keep_alive, self.is_too_large, self.started = is_keep_alive, is_too_large, started


class Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order on one task at a time."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task | None = None
        self.is_closed = False
        self.is_write_paused = False
        self.drain_waiter: asyncio.Future | None = None
        self.last_active = time.monotonic()
        self.receiving_since: float | None = None
        """When the request being received sent its first byte (None between requests)."""
        self.paused_since: float | None = None
        """When the transport's write buffer filled (None while the client keeps reading)."""
        self._reset()

    def _reset(self) -> None:
        self.url, self.headers, self.body, self.size, self.is_too_large = b"", [], [], 0, False
        self.header_bytes = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # once per connection: on Python 3.11 each lookup is a getpid call
        if len(self.server.connections) >= self.server.limits.max_connections:
            self._refuse(503, "too many connections; retry later")
            return
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.is_closed = True
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    def pause_writing(self) -> None:
        self.is_write_paused = True
        self.paused_since = time.monotonic()

    def resume_writing(self) -> None:
        self.is_write_paused = False
        self.paused_since = None
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    async def drain(self) -> None:
        while self.is_write_paused and not self.is_closed:
            self.drain_waiter = self.loop.create_future()
            await self.drain_waiter

    def write(self, data: bytes) -> None:
        if not self.is_closed:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadersTooLarge):
                self._refuse(431, f"request headers are more than {self.server.limits.max_header_bytes} bytes")
            else:
                self._refuse(400, "malformed HTTP request")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def _refuse(self, status: int, message: str) -> None:
        reply = error_reply(status, message)
        self.write(self.server.head(reply, False, len(reply.body)) + reply.body)
        self.transport.close()

    # parser callbacks
    def on_message_begin(self) -> None:
        self._reset()
        self.receiving_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self._count_header_bytes(len(name) + len(value) + 4)

    def _count_header_bytes(self, num: int) -> None:
        self.header_bytes += num
        if self.header_bytes > self.server.limits.max_header_bytes:
            self.headers, self.url = [], b""
            raise _HeadersTooLarge

    def on_headers_complete(self) -> None:
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.server.max_body_bytes:
                self.is_too_large = True
            elif name == b"expect" and value.lower() == b"100-continue" and not self.is_too_large:
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.is_too_large:
            return
        self.size += len(body)
        if self.size > self.server.max_body_bytes:
            self.is_too_large, self.body = True, []
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.receiving_since = None
        self.pending.append(Request(self.parser.get_method(), self.url, self.headers, b"".join(self.body),
                                    self.parser.should_keep_alive(), self.is_too_large, time.monotonic()))
        if self.task is None:
            self.task = self.loop.create_task(self.run())

    async def run(self) -> None:
        try:
            while self.pending and not self.is_closed:
                request = self.pending.popleft()
                await self.server.dispatch(self, request)
                self.last_active = time.monotonic()
                if not request.is_keep_alive:
                    self.transport.close()
                    return
        except asyncio.CancelledError:
            if not self.is_closed:
                raise
        finally:
            self.task = None


class _HeadersTooLarge(Exception):
    """Raised from a parser callback once a request's headers pass `max_header_bytes`."""


class RouterServer:
    """Dispatches parsed requests: the completion routes to `service.serve`, the rest to the ASGI app."""

    def __init__(self, app, max_body_bytes: int, limits=None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.limits = limits or app.state.router.settings
        self.connections: set[Connection] = set()
        self._date = (0, b"")

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
        if content_length is None:
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            parts += [b"content-length: ", str(content_length).encode(), b"\r\n"]
        if not is_keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def dispatch(self, conn: Connection, request: Request) -> None:
        path, _, query = request.url.partition(b"?")
        endpoint = ENDPOINTS.get(path.decode("latin-1")) if request.method == b"POST" else None
        if endpoint is not None:
            await self.completion(conn, request, endpoint)
        else:
            await self.asgi(conn, request, path, query)

    async def completion(self, conn: Connection, request: Request, endpoint: str) -> None:
        state = self.app.state.router
        reply: Reply | None = None
        try:
            if request.is_too_large:
                state.metrics.requests.labels("client_error", "none").inc()
                reply = error_reply(413, f"request body is more than the limit of {self.max_body_bytes} bytes")
            else:
                headers = {name.decode(): value.decode("latin-1") for name, value in request.headers
                           if name in READ_HEADERS}
                reply = await serve(state, endpoint, headers, request.body, request.started)
            await self.write_reply(conn, reply, request.is_keep_alive)
            reply.sent()
        except asyncio.CancelledError:
            if not conn.is_closed:
                raise
            asyncio.current_task().uncancel()
            if reply is not None:
                reply.sent()
                if reply.on_abandon is not None:
                    await reply.on_abandon()
        except Exception:  # noqa: BLE001 - the edge answers every failure as OpenAI JSON
            log.exception("router: unexpected error on %s", request.url.decode("latin-1"))
            if reply is not None:
                reply.sent()
                if reply.on_abandon is not None:
                    await reply.on_abandon()  # a stream that never started: its bookkeeping still runs
            else:
                failed = error_reply(500, "internal router error")
                conn.write(self.head(failed, False, len(failed.body)) + failed.body)
            conn.transport.close()

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
        """Hand a non-hot route to the FastAPI app (router/asgi_bridge.py)."""
        if request.is_too_large:
            reply = error_reply(413, f"request body is more than the limit of {self.max_body_bytes} bytes")
            conn.write(self.head(reply, request.is_keep_alive, len(reply.body)) + reply.body)
            return
        sock = conn.transport.get_extra_info("sockname") or ("", 0)
        peer = conn.transport.get_extra_info("peername") or ("", 0)
        status, headers, body = await call_asgi(self.app, request.method, path, query, request.headers,
                                                request.body, tuple(peer[:2]), tuple(sock[:2]))
        parts = [status_line(status), self.date_header()]
        parts += [b"%s: %s\r\n" % (name, value) for name, value in headers
                  if name.lower() not in (b"content-length", b"transfer-encoding", b"connection")]
        parts.append(b"content-length: %d\r\n" % len(body))
        if not request.is_keep_alive:
            parts.append(b"connection: close\r\n")
        conn.write(b"".join(parts) + b"\r\n" + body)

    def sweep_once(self, now: float) -> None:
        """Close idle keep-alive connections, answer 408 to slow senders, drop stalled readers."""
        limits = self.limits
        for conn in list(self.connections):
            if conn.paused_since is not None and now - conn.paused_since > limits.write_timeout_s:
                log.info("router: client read nothing for %.0f s; disconnecting it", limits.write_timeout_s)
                conn.transport.abort()  # close() would wait for the buffer to drain, which never happens
            elif conn.receiving_since is not None and now - conn.receiving_since > limits.body_read_timeout_s:
                conn.receiving_since = None
                conn._refuse(408, f"request not received within {limits.body_read_timeout_s} s")
            elif conn.task is None and conn.receiving_since is None and now - conn.last_active > limits.keep_alive_s:
                conn.transport.close()

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep_once(time.monotonic())


async def run_server(app, host: str, port: int, sock: socket.socket | None = None, *,
                     stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> None:
    """Serve `app` until SIGTERM/SIGINT (or, when given, until `stop` is set: then no signal handlers are
    installed, as in a test thread): lifespan, listen, drain, shut down. `ready` is set once listening."""
    handle_signals = stop is None
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    async with app.router.lifespan_context(app):
        server = RouterServer(app, app.state.router.settings.max_body_bytes)
        if sock is None:
            listener = await loop.create_server(lambda: Connection(server), host, port, backlog=2048,
                                                reuse_address=True)
        else:
            listener = await loop.create_server(lambda: Connection(server), sock=sock, backlog=2048)
        sweeper = asyncio.create_task(server.sweep())
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        listener.close()
        sweeper.cancel()
        for conn in [c for c in server.connections if c.task is None]:
            conn.transport.close()
        deadline = loop.time() + GRACEFUL_S
        while any(c.task is not None for c in server.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(server.connections):
            conn.transport.close()
