"""Upstream HTTP/1.1 client for the two legs: a keep-alive pool per origin over asyncio + httptools.

Why not httpx for the legs: its pool checks every pooled connection (expiry, socket readability) on every
request, so the router's cost per request grew with its connection count and throughput fell as
concurrency rose. Here each origin (host, port) keeps a LIFO stack of idle connections: a request pops one
(O(1), dropping any the peer closed meanwhile) or opens a new one, and a response that ended cleanly with
keep-alive pushes its connection back. Nothing scans the pool.

Connections per origin are bounded (`max_connections_per_origin`; 0: no bound), as production proxies bound
theirs: beyond the bound a request waits, first come first served, for a connection to come back (handed to
it directly, never parked idle meanwhile) or to close (its slot is handed over: the waiter opens a new one).
A waiter that is cancelled (its leg's deadline, a client that left) takes nothing with it: whatever was
handed to it in the meantime goes to the next waiter or back to the pool. `queued_total` counts the
requests that waited.

A response exposes what the router reads (httpx's names, so an `httpx.Response` satisfies the same
`UpstreamResponse` protocol in in-process tests): `status_code`, `headers` (lower-cased names), `aread()`,
`aiter_raw()` (body bytes as they arrive, chunked encoding removed; what arrived together comes as one
piece, so a relay writes once per read, not once per SSE event), `aclose()`, `is_closed`. A response
not read to its end, a cancelled request or a timeout closes its connection: vLLM aborts a request when
its connection closes. A request that fails on a reused connection before any byte came back (the peer
closed it while idle) is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import httptools
import httpx

HIGH_WATER = 256 * 1024
"""Buffered body bytes at which the connection stops reading until the relay catches up."""


class UpstreamError(Exception):
    """Connecting, sending or reading failed (the node is gone, closed the connection, or spoke garbage)."""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened: the request never reached the node (safe to send elsewhere)."""


UPSTREAM_ERRORS = (UpstreamError, httpx.HTTPError)
"""What a leg catches: this client's errors, and httpx's where tests run the legs over httpx."""
CONNECT_ERRORS = (UpstreamConnectError, httpx.ConnectError)
"""The subset that proves the node never saw the request."""


class UpstreamResponse(Protocol):
    status_code: int
    headers: Mapping[str, str]

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    async def send(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST `body` (JSON) to `url` + `path`; returns once the response headers arrived."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    def __init__(self, pool: UpstreamPool, origin: tuple[str, int]) -> None:
        self.pool, self.origin = pool, origin
        self.loop = asyncio.get_running_loop()
        """Looked up once per connection: on Python 3.11 each lookup is a getpid system call."""
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.parser = httptools.HttpResponseParser(self)
        """One parser for the connection's successive responses; its callbacks go to `response`."""
        self.is_lost = False
        self.is_reused = False
        self.is_counted = False
        """Holds one of its origin's slots (from its opening until it is lost or closed)."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.is_lost = True
        self.pool.forget(self)
        if self.response is not None:
            self.response.fail(UpstreamError(f"connection closed by {self.origin[0]}:{self.origin[1]}"))

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.transport.close()  # bytes nobody asked for: the connection is not reusable
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response.fail(UpstreamError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            response.fail(UpstreamError(f"bad HTTP from {self.origin[0]}:{self.origin[1]}: {exc}"))

    def close(self) -> None:
        self.is_lost = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    # parser callbacks, for the response in flight
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.response.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.response.on_body(body)

    def on_message_complete(self) -> None:
        self.response.on_message_complete()


class Response:
    """One upstream response, fed by its connection's parser."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.parser = conn.parser
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.is_complete = False
        self.is_closed = False
        self.error: Exception | None = None
        self._chunks: list[bytes] = []
        self._num_buffered = 0
        self._waiter: asyncio.Future | None = None
        self._has_headers = False
        self._is_keep_alive = False
        self._is_streaming = False
        self._is_paused = False
        self._content: bytes | None = None

    def on_headers_complete(self) -> None:
        self.status_code = self.parser.get_status_code()
        self._is_keep_alive = self.parser.should_keep_alive()  # only meaningful before the message completes
        self._has_headers = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._num_buffered += len(body)
        if self._is_streaming and self._num_buffered > HIGH_WATER and not self._is_paused:
            self._is_paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_complete = True
        self._wake()

    def fail(self, exc: Exception) -> None:
        if self.error is None and not self.is_complete:
            self.error = exc
        self.conn.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self.conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_headers(self) -> None:
        while not self._has_headers:
            if self.error is not None:
                raise self.error
            await self._wait()

    @property
    def content(self) -> bytes:
        assert self._content is not None, "aread() first"
        return self._content

    async def aread(self) -> bytes:
        if self._content is None:
            try:
                while not self.is_complete:
                    if self.error is not None:
                        raise self.error
                    await self._wait()
            except BaseException:
                self._finish()
                raise
            self._content = b"".join(self._chunks)
            self._chunks.clear()
            self._finish()
        return self._content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        self._is_streaming = True
        try:
            while True:
                if self._chunks:
                    chunks, self._chunks, self._num_buffered = self._chunks, [], 0
                    if self._is_paused:
                        self._is_paused = False
                        self.conn.transport.resume_reading()
                    yield chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one client write per read
                    continue
                if self.is_complete:
                    return
                if self.error is not None:
                    raise self.error
                await self._wait()
        finally:
            self._finish()

    async def aclose(self) -> None:
        self._finish()

    def _finish(self) -> None:
        """Hand the connection back when the response ended cleanly; close it otherwise."""
        if self.is_closed:
            return
        self.is_closed = True
        conn = self.conn
        conn.response = None
        if self.is_complete and self.error is None and not self._chunks and self._is_keep_alive:
            self.conn.pool.release(conn)
        else:
            conn.close()


class Origin:
    """One (host, port): its idle connections, how many are open, and the requests waiting for one."""

    __slots__ = ("key", "host_line", "idle", "num_open", "waiters")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.host_line = f"Host: {key[0]}:{key[1]}\r\n".encode()
        self.idle: list[Connection] = []
        self.num_open = 0
        """Connections that hold a slot: being opened, carrying a response, or idle."""
        self.waiters: deque[asyncio.Future] = deque()
        """Requests waiting for a slot; each future gets a Connection to reuse, or None: open one."""


class UpstreamPool:
    """Keep-alive connections per origin, at most `max_connections_per_origin` each (0: no bound); `send` is
    the only entry point."""

    def __init__(self, connect_timeout_s: float, max_idle_per_origin: int = 512,
                 max_connections_per_origin: int = 0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.max_connections_per_origin = max_connections_per_origin
        self.queued_total = 0
        """Requests that waited for a connection because their origin was at its bound."""
        self._by_key: dict[tuple[str, int], Origin] = {}
        self._by_url: dict[str, Origin] = {}

    def origin(self, url: str) -> Origin:
        known = self._by_url.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"only http:// origins are supported, got {url!r}")
            key = (parts.hostname, parts.port or 80)
            known = self._by_key.get(key) or self._by_key.setdefault(key, Origin(key))
            self._by_url[url] = known
        return known

    async def _connect(self, origin: Origin) -> Connection:
        """Open a connection in a slot the caller holds; the slot is handed on when opening fails."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(self, origin.key), *origin.key)
        except BaseException as exc:
            self._free_slot(origin)
            if isinstance(exc, (OSError, TimeoutError)):
                raise UpstreamConnectError(f"cannot connect to {origin.key[0]}:{origin.key[1]}: "
                                           f"{type(exc).__name__} {exc}") from None
            raise
        if conn.is_lost:  # closed by the peer before this request could use it
            self._free_slot(origin)
            raise UpstreamConnectError(f"cannot connect to {origin.key[0]}:{origin.key[1]}: closed at once")
        conn.is_counted = True
        return conn

    async def acquire(self, origin: Origin, is_idle_allowed: bool = True) -> Connection:
        """A connection of `origin` for one request: an idle one, a new one while under the bound, else the
        first one handed over once the requests ahead of this one got theirs."""
        if is_idle_allowed and not origin.waiters:
            stack = origin.idle
            while stack:
                conn = stack.pop()
                if not conn.is_lost and not conn.transport.is_closing():
                    conn.is_reused = True
                    return conn
        bound = self.max_connections_per_origin
        if not bound or origin.num_open < bound:
            origin.num_open += 1
            return await self._connect(origin)
        self.queued_total += 1
        waiter = asyncio.get_running_loop().create_future()
        origin.waiters.append(waiter)
        try:
            conn = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed over as this request was cancelled
                handed = waiter.result()
                self.release(handed) if handed is not None else self._free_slot(origin)
            raise
        if conn is None:
            return await self._connect(origin)
        if conn.is_lost:  # closed while handed over: its slot went on already
            return await self.acquire(origin, is_idle_allowed)
        conn.is_reused = True
        return conn

    def release(self, conn: Connection) -> None:
        """A connection whose response ended cleanly: to the first waiter, else onto the idle stack."""
        if conn.is_lost:
            return
        origin = self._by_key[conn.origin]
        waiters = origin.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        stack = origin.idle
        if len(stack) >= self.max_idle_per_origin:
            conn.close()
        else:
            stack.append(conn)

    def forget(self, conn: Connection) -> None:
        """A connection closed (by either side): its slot goes to the first waiter or is freed."""
        if conn.is_counted:
            conn.is_counted = False
            self._free_slot(self._by_key[conn.origin])

    def _free_slot(self, origin: Origin) -> None:
        waiters = origin.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot stays counted: the waiter opens a connection in it
                return
        origin.num_open -= 1

    async def send(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        origin = self.origin(url)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\n", origin.host_line,
                b"Content-Type: application/json\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        request = b"".join(head) + b"\r\n" + body
        for attempt in range(2):
            conn = await self.acquire(origin, is_idle_allowed=attempt == 0)
            response = Response(conn)
            conn.response = response
            conn.transport.write(request)
            try:
                await response.wait_headers()
                return response
            except UpstreamError:
                response._finish()
                if attempt == 1 or not conn.is_reused or response._has_headers:
                    raise
            except BaseException:
                response._finish()
                raise
        raise AssertionError("unreachable")

    def num_open(self, url: str) -> int:
        """Connections of `url`'s origin that hold a slot (being opened, busy or idle)."""
        return self.origin(url).num_open

    def close(self) -> None:
        for origin in self._by_key.values():
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()


class HttpxUpstream:
    """The `Upstream` protocol over an httpx client (in-process tests route it to ASGI apps)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def send(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        request = self.client.build_request("POST", f"{url}{path}", content=body,
                                            headers={"content-type": "application/json", **headers})
        return await self.client.send(request, stream=True)
