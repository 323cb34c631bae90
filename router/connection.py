"""One client connection of the router's HTTP/1.1 server (router/server.py): parses requests (httptools) and has
them answered one at a time, in the order they arrived (keep-alive, pipelining).

What a connection decides while receiving, before any route runs. Each decision is a `Request` whose `refusal`
is set, answered in its turn like any other; every refusal but a 413 of a body that was read ends the
connection, and nothing more of it is parsed. From the refusal on the socket is not read (TCP pushes back on a
client still sending), and after the answer the connection closes lingering: it half-closes (the client reads the
answer to its end) and drops what the client still sends, at most `LINGER_BYTES` for `LINGER_S`, until the client
closes - so a client that reads while it sends gets its answer, not a reset, and a refused request's rest (an 8 MB
header, a huge body) is never read whole:
- request line + headers past `max_header_bytes`: 431; unparsable: 400; `CONNECT`: 405;
- a body declared or grown past `max_body_bytes`: 413. With `Expect: 100-continue` the body is never read: the
  413 answers the head and the connection closes (RFC 9110 10.1.1); without, the body is read and dropped;
- `Upgrade`: ignored, the request is answered over HTTP/1.1 and the connection stays HTTP/1.1 (RFC 9110 7.8;
  never a 101); an upgrade request that carries a body gets 400 (the parser leaves such a body to the new
  protocol);
- a request whose head is not complete within `head_read_timeout_s`, or whose head and body are not within
  `body_read_timeout_s`, of its first byte (counted from its turn when requests before it were still being
  answered): 408, from the server's sweep (`enforce_timeouts`, which also disconnects a client that read nothing
  for `write_timeout_s`, closes a new connection that sent no request within `head_read_timeout_s` and one idle
  for `keep_alive_s`; bytes that begin no request, such as blank lines, are no activity); past `max_connections`
  a new connection gets 503;
- pipelining is bounded: at most `max_pipelined_requests` received requests (and about `max_body_bytes` of their
  bodies) wait for their turn. At the bound the rest of what was read is held unparsed and the socket is not read
  until the queue shortens (TCP pushes back on the client). To stop exactly at the bound, a read that could hold
  more requests than the queue has room for is parsed piece by piece: up to each head's end (`\n\r\n`) and
  then exactly its `Content-Length`, so no piece completes more than one request.
A refusal answers a `HEAD` without a body, as every answer to a `HEAD` is.
`Expect: 100-continue` on an HTTP/1.1 request is answered `100 Continue` in the request's turn: at once on an
idle connection, else once the answers before it were written. A client that disconnects cancels the
request being answered (`connection_lost`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import httptools

from router.service import Reply, error_reply

if TYPE_CHECKING:
    from router.server import RouterServer

log = logging.getLogger("router")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER_S = 2.0
"""After a refusal's answer, how long the connection waits for the client to close (dropping what it sends)."""
LINGER_BYTES = 16 << 20
"""After a refusal's answer, how many more bytes the connection drops before it closes without waiting: above
what a client's and the router's socket buffers hold (a few MB each), so what was in flight when the client saw
its answer is dropped, not answered with a reset."""


class Refused(Exception):
    """Raised in a parser callback: answer `status` in this request's turn and read nothing more."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Request:
    """One received request, or a refusal decided while receiving (`refusal` set: nothing is dispatched)."""

    __slots__ = ("method", "url", "headers", "body", "is_keep_alive", "refusal", "started")

    def __init__(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                 is_keep_alive: bool, refusal: Reply | None, started: float) -> None:
        self.method, self.url, self.headers, self.body = method, url, headers, body
        self.is_keep_alive, self.refusal, self.started = is_keep_alive, refusal, started


class Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order on one task at a time."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.limits = server.limits
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Request] = deque()
        self.num_pending_bytes = 0
        """Body bytes of the requests in `pending` (bounded with their count: `_is_queue_full`)."""
        self.is_reading_paused = False
        self.held = b""
        """Bytes read but not parsed while the queue is full (fed once it shortens)."""
        self.body_remaining = 0
        """Bytes of the declared Content-Length body not yet received (cuts the pieces of a bounded parse)."""
        self.num_requests = 0
        """Requests received whole on this connection."""
        self.task: asyncio.Task | None = None
        """Answers the pending requests; None while the connection is idle."""
        self.is_closed = False
        self.is_answering = False
        """Bytes of the current request's answer were written (a failure can no longer answer 500)."""
        self.is_refusing = False
        """A refusal is queued: nothing more is parsed (the socket is not read until its answer is written)."""
        self.linger_bytes_left: int | None = None
        """Lingering after a refusal's answer: what may still be dropped before closing (None: not lingering)."""
        self.linger_timer: asyncio.TimerHandle | None = None
        self.is_continue_owed = False
        """The request being received expects `100 Continue` once the answers before it are written."""
        self.is_write_paused = False
        self.drain_waiter: asyncio.Future | None = None
        self.last_active = time.monotonic()
        self.receiving_since: float | None = None
        """When the request being received sent its first byte, or its turn came (None between requests)."""
        self.paused_since: float | None = None
        """When the transport's write buffer filled (None while the client keeps reading)."""
        self._reset()

    def _reset(self) -> None:
        self.url, self.headers, self.body, self.size, self.is_too_large = b"", [], [], 0, False
        self.header_bytes = 0
        self.num_head_bytes_fed = 0
        """Bytes fed while this request's head was open from the piece before on (httptools keeps a header's
        value until it ends: this bounds a head that never ends, `_bound_open_head`)."""
        self.method = b""
        self.is_head_complete = False
        self.is_receiving_head = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # once per connection: on Python 3.11 each lookup is a getpid call
        if len(self.server.connections) >= self.limits.max_connections:
            log.warning("router: connection refused with 503: %d connections open (max_connections)",
                        len(self.server.connections))
            self.refuse(503, "too many connections; retry later")
            return
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.is_closed = True
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    def close(self) -> None:
        self.is_closed = True
        self.transport.close()

    def linger(self) -> None:
        """A refusal was answered: half-close, then drop what the client still sends until it closes, at most
        `LINGER_BYTES` for `LINGER_S` (see the module docstring)."""
        if self.is_closed:
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after the answer, which is still buffered if the client reads slowly
        self.linger_bytes_left = LINGER_BYTES
        self.linger_timer = self.loop.call_later(LINGER_S, self.close)
        self.is_reading_paused = False
        self.transport.resume_reading()

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
            self.is_answering = True
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.is_refusing:  # read before the pause took effect, or while lingering: dropped
            if self.linger_bytes_left is not None:
                self.linger_bytes_left -= len(data)
                if self.linger_bytes_left < 0:
                    self.close()
            return
        if self.held:  # read before the pause took effect: after what is held
            self.held += data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` without letting more than `max_pipelined_requests` wait; hold the rest (see the docstring)."""
        while data and not self.is_refusing:
            if self._is_queue_full():
                self.held = data
                if not self.is_reading_paused and not self.is_closed:
                    self.is_reading_paused = True
                    self.transport.pause_reading()
                return
            if len(self.pending) + data.count(b"\n\r\n") < self.limits.max_pipelined_requests:
                self._parse(data)  # it cannot complete enough requests to pass the bound: all at once
                return
            cut = self.body_remaining if self.body_remaining else data.find(b"\n\r\n") + 3
            if cut <= 2 or cut > len(data):
                cut = len(data)
            self._parse(data[:cut])
            data = data[cut:]

    def _parse(self, data: bytes) -> None:
        was_head_open = self.is_receiving_head
        try:
            self.parser.feed_data(data)
            if was_head_open and self.is_receiving_head:
                self._bound_open_head(len(data))
        except httptools.HttpParserUpgrade as exc:  # the request is queued: what follows it is HTTP/1.1 again
            self._feed(data[exc.args[0]:])
        except httptools.HttpParserCallbackError as exc:  # no local may keep the error: its frames hold this one
            if isinstance(exc.__context__, Refused):
                self.refuse(exc.__context__.status, exc.__context__.message)
            else:
                self.refuse(400, "malformed HTTP request")
        except httptools.HttpParserError as exc:
            self.refuse(400, f"malformed HTTP request: {exc}")

    def _bound_open_head(self, num: int) -> None:
        """A piece that was all head (it began open and left it open): 431 once such pieces pass
        `max_header_bytes`, before httptools has kept a huge header value whole (the exact count, `on_header`, comes
        only when a header ends). The piece a head began in is not counted, so this bound is loose by one read."""
        self.num_head_bytes_fed += num
        if self.num_head_bytes_fed > self.limits.max_header_bytes:
            self.refuse(431, f"request headers are more than {self.limits.max_header_bytes} bytes")

    def _is_queue_full(self) -> bool:
        return len(self.pending) >= self.limits.max_pipelined_requests \
            or self.num_pending_bytes >= self.limits.max_body_bytes

    def _make_room(self) -> None:
        """A request left the queue: parse what was held, then read the socket again while there is room."""
        if self.held and not self._is_queue_full():
            data, self.held = self.held, b""
            self._feed(data)
        if self.is_reading_paused and not self.held and not self._is_queue_full() and not self.is_closed \
                and not self.is_refusing:
            self.is_reading_paused = False
            self.transport.resume_reading()

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` once the requests before it are answered, then close lingering (`linger`); stop
        reading now."""
        self.is_refusing = True
        if not self.is_reading_paused and not self.is_closed:
            self.is_reading_paused = True
            self.transport.pause_reading()
        self.is_continue_owed = False
        self.receiving_since = None
        self.is_receiving_head = False
        self.parser = None  # also drops the parser's last error, whose frames would keep this connection alive
        self.held = b""
        self._queue(Request(self.method, self.url, [], b"", False, error_reply(status, message), time.monotonic()))

    def _queue(self, request: Request) -> None:
        self.pending.append(request)
        self.num_pending_bytes += len(request.body)
        if self.task is None:
            self.task = self.loop.create_task(self.run())

    # parser callbacks
    def on_message_begin(self) -> None:
        self._reset()
        self.is_receiving_head = True
        self.receiving_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        if not self.url:
            self.method = self.parser.get_method()  # a refusal of this request answers a HEAD without a body
        self.url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self._count_header_bytes(len(name) + len(value) + 4)

    def _count_header_bytes(self, num: int) -> None:
        self.header_bytes += num
        if self.header_bytes > self.limits.max_header_bytes:
            self.headers, self.url = [], b""
            raise Refused(431, f"request headers are more than {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self.is_head_complete = True
        self.is_receiving_head = False
        has_body = is_expecting = False
        for name, value in self.headers:
            if name == b"content-length":
                has_body = not value.isdigit() or int(value) > 0
                self.body_remaining = int(value) if value.isdigit() and len(value) < 19 else 0
                self.is_too_large = value.isdigit() and int(value) > self.limits.max_body_bytes
            elif name == b"transfer-encoding":
                has_body = True
            elif name == b"expect" and value.lower() == b"100-continue":
                is_expecting = True
        parser = self.parser
        if parser.should_upgrade():
            if parser.get_method() == b"CONNECT":
                raise Refused(405, "CONNECT is not supported")
            if has_body:
                raise Refused(400, "this server speaks HTTP/1.1 only: send a request with a body without Upgrade")
        if is_expecting and parser.get_http_version() == "1.1":  # an HTTP/1.0 expectation is ignored
            if self.is_too_large:
                raise Refused(413, f"request body is more than the limit of {self.limits.max_body_bytes} bytes")
            if self.task is None:
                self.transport.write(CONTINUE)
            else:
                self.is_continue_owed = True

    def on_body(self, body: bytes) -> None:
        self.body_remaining = max(0, self.body_remaining - len(body))
        if self.is_too_large:
            return
        self.size += len(body)
        if self.size > self.limits.max_body_bytes:
            self.is_too_large, self.body = True, []
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.receiving_since = None
        self.body_remaining = 0
        self.num_requests += 1
        refusal = error_reply(413, f"request body is more than the limit of {self.limits.max_body_bytes} bytes") \
            if self.is_too_large else None
        self._queue(Request(self.parser.get_method(), self.url, self.headers, b"".join(self.body),
                            self.parser.should_keep_alive(), refusal, time.monotonic()))

    async def run(self) -> None:
        try:
            while self.pending and not self.is_closed:
                request = self.pending.popleft()
                self.num_pending_bytes -= len(request.body)
                self._make_room()
                await self.server.dispatch(self, request)
                self.last_active = time.monotonic()
                if not request.is_keep_alive:
                    if self.is_refusing and not self.pending:  # this was the refusal
                        self.linger()
                    else:
                        self.close()
                    return
            if self.is_continue_owed and not self.is_closed:  # the request being received: its turn now
                self.is_continue_owed = False
                self.transport.write(CONTINUE)
            if self.receiving_since is not None:
                self.receiving_since = time.monotonic()
        except asyncio.CancelledError:
            if not self.is_closed:
                raise
        finally:
            self.task = None

    def enforce_timeouts(self, now: float) -> None:
        """Disconnect a client that reads nothing, answer 408 to a slow sender, close an idle connection."""
        limits = self.limits
        if self.paused_since is not None and now - self.paused_since > limits.write_timeout_s:
            log.info("router: client read nothing for %.0f s; disconnecting it", limits.write_timeout_s)
            self.transport.abort()  # close() would wait for the buffer to drain, which never happens
        elif self.task is not None:
            return  # answering: the request being received waits for its turn
        elif self.receiving_since is not None and not self.is_head_complete \
                and now - self.receiving_since > limits.head_read_timeout_s:
            self.refuse(408, f"request head not received within {limits.head_read_timeout_s} s")
        elif self.receiving_since is not None and now - self.receiving_since > limits.body_read_timeout_s:
            self.refuse(408, f"request not received within {limits.body_read_timeout_s} s")
        elif self.receiving_since is None and now - self.last_active > \
                (limits.keep_alive_s if self.num_requests else limits.head_read_timeout_s):
            self.close()
