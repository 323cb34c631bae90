"""Upstream HTTP/1.1 client for the two legs: a keep-alive pool per origin over asyncio + httptools.

Why not httpx for the legs: its pool checks every pooled connection (expiry, socket readability) on every
request, so the router's cost per request grew with its connection count and throughput fell as
concurrency rose. Here each origin (host, port) keeps a LIFO stack of idle connections: a request pops one
(O(1), dropping any the peer closed meanwhile) or opens a new one, and a response that ended cleanly with
keep-alive pushes its connection back. Nothing scans the pool.

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
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.parser = httptools.HttpResponseParser(self)
        """One parser for the connection's successive responses; its callbacks go to `response`."""
        self.is_lost = False
        self.is_reused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.is_lost = True
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
        self._waiter = asyncio.get_running_loop().create_future()
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


class UpstreamPool:
    """Keep-alive connections per origin; `send` is the only entry point."""

    def __init__(self, connect_timeout_s: float, max_idle_per_origin: int = 512) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._origins: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _origin(self, url: str) -> tuple[tuple[str, int], bytes]:
        known = self._origins.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"only http:// origins are supported, got {url!r}")
            port = parts.port or 80
            known = ((parts.hostname, port), f"Host: {parts.hostname}:{port}\r\n".encode())
            self._origins[url] = known
        return known

    async def _connect(self, origin: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(self, origin), *origin)
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {type(exc).__name__} {exc}") \
                from None
        return conn

    def _acquire_idle(self, origin: tuple[str, int]) -> Connection | None:
        stack = self._idle.get(origin)
        while stack:
            conn = stack.pop()
            if not conn.is_lost and not conn.transport.is_closing():
                conn.is_reused = True
                return conn
        return None

    def release(self, conn: Connection) -> None:
        if conn.is_lost:
            return
        stack = self._idle.setdefault(conn.origin, [])
        if len(stack) >= self.max_idle_per_origin:
            conn.close()
        else:
            stack.append(conn)

    async def send(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        origin, host_line = self._origin(url)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\n", host_line,
                b"Content-Type: application/json\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        request = b"".join(head) + b"\r\n" + body
        for attempt in range(2):
            conn = self._acquire_idle(origin) if attempt == 0 else None
            conn = conn or await self._connect(origin)
            response = Response(conn)
            conn.response = response
            conn.transport.write(request)
            try:
                await response.wait_headers()
                return response
            except UpstreamError:
                response._finish()
                if not conn.is_reused or response._has_headers:
                    raise
            except BaseException:
                response._finish()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()


class HttpxUpstream:
    """The `Upstream` protocol over an httpx client (in-process tests route it to ASGI apps)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def send(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        request = self.client.build_request("POST", f"{url}{path}", content=body,
                                            headers={"content-type": "application/json", **headers})
        return await self.client.send(request, stream=True)
