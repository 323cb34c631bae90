"""How a node's HTTP server runs: uvicorn limits, bounded request bodies, a write timeout, the drain on SIGTERM
and the separate metrics port.

- `GuardMiddleware` (pure ASGI) reads a request body completely before the app sees it, refusing one larger than
  `max_body_bytes` (413), slower than `body_read_timeout_s` (408), or JSON nested too deep, holding a lone
  surrogate, or NUL outside text for the model, on any route (400 naming the field: serving/json_guard.py), as
  OpenAI error JSON; a response chunk the
  client does not take within `stream_write_timeout_s` ends the response as a client disconnect would (the
  request is aborted and its rows freed), so a stalled SSE reader cannot hold a stream forever.
- `Drain`: on SIGTERM the node stops admitting (new requests get 503 + Retry-After, /health 503 so readiness
  fails and the router stops placing here), lets in-flight requests finish for at most `drain_s`, then exits.
  `DrainingServer` is uvicorn's server with that first SIGTERM turned into a drain (a second SIGTERM or a
  SIGINT during the drain exits at once).
- `MetricsServer`: GET /metrics (only) on `metrics_port`, a second uvicorn server on its own thread, so a
  NetworkPolicy can open metrics to monitoring without opening the API.
- `head_timeout_protocol(seconds)`: uvicorn's h11 protocol with a request-head deadline: a connection must
  deliver a whole request head (line and headers) within `http_head_timeout_s` of opening, or of the first byte
  of its next head, else it is closed (with 408 when part of a head arrived); a client trickling a header a byte
  at a time (slowloris) holds a connection no longer than that. uvicorn alone only times out idle keep-alive
  connections, and any byte restarts that. A head h11 refuses (a NUL or CR in a header value, a bad request
  line) is answered 400 as OpenAI error JSON, not uvicorn's plain text.
- `serve(app, settings)`: all of the above with the settings' uvicorn limits (h11, so the header bound applies).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from node.settings import NodeSettings
from serving.errors import APIError, error_body
from serving.json_guard import check_body

log = logging.getLogger("pdcluster.node")


class Drain:
    """The node's shutdown state: `begin()` once, then `is_over(num_in_flight)` says when to exit."""

    def __init__(self, drain_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.drain_s = drain_s
        self._clock = clock
        self.started_at: float | None = None

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = self._clock()
            log.warning("draining: new requests get 503, in-flight ones have %.0f s to finish", self.drain_s)

    def remaining_s(self) -> float:
        if self.started_at is None:
            return self.drain_s
        return max(0.0, self.started_at + self.drain_s - self._clock())

    def is_over(self, num_in_flight: int) -> bool:
        return self.active and (num_in_flight == 0 or self.remaining_s() <= 0)


async def _json(send: Any, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = (),
                param: str | None = None) -> None:
    import json

    body = json.dumps(error_body(status, message, param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """Bounded body (size, time) and a per-chunk write timeout (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int, body_read_timeout_s: float, write_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.write_timeout_s = write_timeout_s

    async def _read_body(self, receive: Any, send: Any) -> list[dict] | None:
        """The request's body messages, or None after answering 413 / 408 / nothing (client gone)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_read_timeout_s
        messages, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _json(send, 408, f"the request body did not arrive within {self.body_read_timeout_s:g} s")
                return None
            if message["type"] != "http.request":
                return None  # disconnected before the body ended
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await _json(send, 413, f"the request body exceeds {self.max_body_bytes} bytes")
                return None
            messages.append(message)
            if not message.get("more_body", False):
                return messages

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return await _json(send, 413, f"the request body exceeds {self.max_body_bytes} bytes")
        body = await self._read_body(receive, send)
        if body is None:
            return
        try:
            check_body(b"".join(message.get("body", b"") for message in body))
        except APIError as exc:
            return await _json(send, exc.status, exc.message, param=exc.param)
        gone = asyncio.Event()
        pending: list[asyncio.Future] = []

        async def replay() -> dict:
            if body:
                return body.pop(0)
            if gone.is_set():
                return {"type": "http.disconnect"}
            if not pending:
                pending.append(asyncio.ensure_future(receive()))
            waiter = asyncio.ensure_future(gone.wait())
            try:
                await asyncio.wait({pending[0], waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if pending[0].done():
                return pending.pop().result()
            return {"type": "http.disconnect"}

        async def guarded_send(message: dict) -> None:
            if gone.is_set():
                return
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                log.warning("a client took no bytes for %.0f s: ending its response", self.write_timeout_s)
                gone.set()  # the app sees a disconnect: the request is aborted

        try:
            await self.app(scope, replay, guarded_send)
        finally:
            for future in pending:
                future.cancel()


def _head_timeout_answer(seconds: float) -> bytes:
    import json

    body = json.dumps(error_body(408, f"the request head did not arrive within {seconds:g} s")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def head_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol whose connections must send each request head within `seconds` (module docstring)."""

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:  # part of a head arrived: the client waits for an answer
                self.transport.write(_head_timeout_answer(seconds))
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:  # a next head on a kept-alive
                self._arm()  # connection starts (while idle, uvicorn's keep-alive timeout applies)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived: the body has its own deadline
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (bad line or header, a NUL or CR in a value): OpenAI error JSON, closed."""
            import json

            self._disarm()
            body = json.dumps(error_body(400, f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return HeadTimeoutProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM drains (`Drain`) instead of exiting at once; with `hand_off_s` the
    requests still running that long after it are handed off (`hand_off()`, once: router/migration.py)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, in_flight: Callable[[], int],
                 hand_off_s: float | None = None, hand_off: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.drain = drain
        self.in_flight = in_flight
        self.hand_off_s, self.hand_off = hand_off_s, hand_off

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.active:
            self.drain.begin()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.hand_off is not None and self.hand_off_s is not None and self.drain.active \
                and self.drain.drain_s - self.drain.remaining_s() >= self.hand_off_s:
            hand_off, self.hand_off = self.hand_off, None
            hand_off()
        if self.drain.is_over(self.in_flight()):
            self.should_exit = True
        return await super().on_tick(counter)


class MetricsServer:
    """GET /metrics on its own port, served from a daemon thread (see the module docstring)."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes], head_timeout_s: float = 10.0) -> None:
        from fastapi import FastAPI
        from fastapi.responses import Response

        from serving.errors import install_error_handlers

        app = FastAPI(title="pdcluster node metrics", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)  # a bad path or method here is OpenAI JSON too

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="off",
                                http=head_timeout_protocol(head_timeout_s), limit_concurrency=16,
                                timeout_keep_alive=15)  # the API server owns logging
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="pdcluster-metrics", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the metrics server did not start on port {self.server.config.port}")
            if time.monotonic() > deadline:
                raise RuntimeError("the metrics server did not start in time")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


def uvicorn_config(app: Any, settings: NodeSettings, log_level: str = "warning") -> uvicorn.Config:
    """The node's uvicorn limits (docstrings of the settings fields)."""
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level,
        http=head_timeout_protocol(settings.http_head_timeout_s),
        limit_concurrency=settings.http_limit_concurrency, timeout_keep_alive=settings.http_keep_alive_s,
        h11_max_incomplete_event_size=settings.http_max_header_bytes,
        timeout_graceful_shutdown=5,
    )


def serve(app: Any, settings: NodeSettings, log_level: str = "warning") -> None:
    """Run the node app until SIGTERM's drain (or SIGINT) ends it."""
    server = DrainingServer(uvicorn_config(app, settings, log_level), app.state.drain, app.state.num_in_flight,
                            settings.drain_hand_off_s, app.state.hand_off)
    server.run()
