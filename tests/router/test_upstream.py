"""The upstream pool (router/upstream.py) against real sockets on 127.0.0.1: keep-alive reuse, streamed
bodies, `connection: close`, a reused connection the peer dropped, cancellation and refused connections,
and the bound on connections per origin (waiters served in order, slots handed over, cancelled waiters)."""

from __future__ import annotations

import asyncio

import pytest

from router.upstream import UpstreamError, UpstreamPool
from tests.router.wire_fake import FakeEngine

pytestmark = pytest.mark.process


class Server:
    """A server on a free port whose protocol instances are recorded (one per accepted connection)."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.protocols: list[asyncio.Protocol] = []

    async def __aenter__(self) -> str:
        def make():
            proto = self.factory()
            self.protocols.append(proto)
            return proto

        self.server = await asyncio.get_running_loop().create_server(make, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


class Scripted(asyncio.Protocol):
    """Answers the n-th request on its connection with `answers[n]` (None: close without answering,
    "hang": never answer); records whether the peer closed."""

    def __init__(self, answers: list) -> None:
        self.answers, self.num_requests, self.is_closed_by_peer = answers, 0, False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not data.startswith(b"POST "):
            return
        answer = self.answers[min(self.num_requests, len(self.answers) - 1)]
        self.num_requests += 1
        if answer is None:
            self.transport.close()
        elif answer != "hang":
            self.transport.write(answer)

    def connection_lost(self, exc) -> None:
        self.is_closed_by_peer = True


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def run(coro):
    return asyncio.run(coro)


def test_sequential_requests_reuse_one_connection():
    async def main():
        server = Server(lambda: FakeEngine("p", 256, {"requests": 0}))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            for _ in range(5):
                resp = await pool.send(url, "/v1/completions", b'{"max_tokens": 3}', {"X-Request-Id": "r1"})
                assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
                assert b"t0 t1 t2" in await resp.aread()
            pool.close()
        return server

    server = run(main())
    assert len(server.protocols) == 1


def test_streamed_body_arrives_in_order_and_the_connection_is_reused():
    async def main():
        server = Server(lambda: FakeEngine("d", 256, {"requests": 0}))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            for _ in range(2):
                resp = await pool.send(url, "/v1/completions", b'{"max_tokens": 5, "stream": true}', {})
                body = b"".join([chunk async for chunk in resp.aiter_raw()])
                assert body.count(b"data: {") == 5 and body.endswith(b"data: [DONE]\n\n")
                assert b"transfer-encoding" not in body and b"\r\n" not in body, "chunked framing removed"
            pool.close()
        return server

    assert len(run(main()).protocols) == 1


def test_connection_close_answer_is_not_reused():
    async def main():
        server = Server(lambda: Scripted([ok(b"{}", b"connection: close\r\n")]))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            for _ in range(2):
                resp = await pool.send(url, "/x", b"{}", {})
                assert await resp.aread() == b"{}"
            pool.close()
        return server

    assert len(run(main()).protocols) == 2


def test_reused_connection_dropped_by_the_peer_is_retried_on_a_fresh_one():
    async def main():
        # First connection: answers once, then closes on the next request without a byte back.
        server = Server(lambda: Scripted([ok(b"first"), None]))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            assert await (await pool.send(url, "/x", b"{}", {})).aread() == b"first"
            assert await (await pool.send(url, "/x", b"{}", {})).aread() == b"first"
            pool.close()
        return server

    assert len(run(main()).protocols) == 2


def test_fresh_connection_dropped_before_an_answer_raises():
    async def main():
        async with Server(lambda: Scripted([None])) as url:
            pool = UpstreamPool(connect_timeout_s=5)
            with pytest.raises(UpstreamError):
                await pool.send(url, "/x", b"{}", {})

    run(main())


def test_cancelled_request_closes_its_connection():
    async def main():
        server = Server(lambda: Scripted(["hang"]))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await pool.send(url, "/x", b"{}", {})
            for _ in range(100):
                if server.protocols[0].is_closed_by_peer:
                    break
                await asyncio.sleep(0.02)
            assert server.protocols[0].is_closed_by_peer, "the node must see the connection close (vLLM aborts)"
            assert not pool.origin(url).idle and pool.num_open(url) == 0

    run(main())


def test_unread_stream_closes_its_connection():
    async def main():
        server = Server(lambda: FakeEngine("d", 256, {"requests": 0}))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            resp = await pool.send(url, "/v1/completions", b'{"max_tokens": 200, "stream": true}', {})
            chunks = resp.aiter_raw()
            assert (await anext(chunks)).startswith(b"data: ")
            await resp.aclose()
            await (await pool.send(url, "/v1/completions", b'{"max_tokens": 1}', {})).aread()
            pool.close()
        return server

    assert len(run(main()).protocols) == 2, "a half-read response's connection is never reused"


def test_refused_connection_raises_upstream_error():
    async def main():
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await UpstreamPool(connect_timeout_s=5).send(f"http://127.0.0.1:{port}", "/x", b"{}", {})

    run(main())


class Held(asyncio.Protocol):
    """Records each request's body in `log` (in arrival order) and answers it once the test calls
    `answer()` (one pending request per connection at a time)."""

    def __init__(self, log: list[bytes], close: bool = False) -> None:
        self.log, self.close, self.pending = log, close, False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.log.append(data.rpartition(b"\r\n\r\n")[2])
        self.pending = True

    def answer(self) -> None:
        self.pending = False
        self.transport.write(ok(b"done", b"connection: close\r\n" if self.close else b""))


async def until(predicate) -> None:
    """Yield to the loop until `predicate()` holds (bounded by the test's own timeout)."""
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.005)


async def send_all(pool: UpstreamPool, url: str, bodies: list[bytes]) -> list[asyncio.Task]:
    """Start one request per body, each once the one before it is sent or waiting (arrival order = list order)."""
    tasks = []
    for body in bodies:
        num_before = pool.queued_total
        tasks.append(asyncio.create_task(pool.send(url, "/x", body, {})))
        await until(lambda: pool.queued_total > num_before or pool.num_open(url) > len(tasks) - 1)
    return tasks


def test_bound_queues_requests_beyond_it_and_serves_them_in_order_on_the_same_connections():
    async def main():
        log: list[bytes] = []
        server = Server(lambda: Held(log))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5, max_connections_per_origin=2)
            tasks = await send_all(pool, url, [b"r%d" % i for i in range(6)])
            assert pool.queued_total == 4 and pool.num_open(url) == 2
            read: set[asyncio.Task] = set()
            for num_answered in range(6):
                await until(lambda: sum(p.pending for p in server.protocols) == min(2, 6 - num_answered))
                next(p for p in server.protocols if p.pending).answer()
                await until(lambda: sum(t.done() for t in tasks) == num_answered + 1)
                done = next(t for t in tasks if t.done() and t not in read)
                read.add(done)
                assert await done.result().aread() == b"done"  # the connection goes back: to the next waiter
            assert pool.num_open(url) == 2
            pool.close()
        return server, log

    server, log = run(main())
    assert len(server.protocols) == 2, "never more connections than the bound"
    assert log == [b"r%d" % i for i in range(6)], "waiting requests go out in the order they arrived"


def test_a_closed_connection_hands_its_slot_to_the_next_waiter():
    async def main():
        log: list[bytes] = []
        server = Server(lambda: Held(log, close=True))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5, max_connections_per_origin=1)
            tasks = await send_all(pool, url, [b"a", b"b", b"c"])
            for num_answered in range(3):
                await until(lambda: any(p.pending for p in server.protocols))
                next(p for p in server.protocols if p.pending).answer()
                assert await (await tasks[num_answered]).aread() == b"done"
            await until(lambda: pool.num_open(url) == 0)
        return server, log

    server, log = run(main())
    assert len(server.protocols) == 3 and log == [b"a", b"b", b"c"]


def test_a_cancelled_waiter_takes_no_slot_with_it():
    """One waiter is cancelled while it waits, the next just as the connection is handed to it: the
    connection goes on to the last waiter either way."""
    async def main():
        log: list[bytes] = []
        server = Server(lambda: Held(log))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5, max_connections_per_origin=1)
            first, gone, handed, last = await send_all(pool, url, [b"first", b"gone", b"handed", b"last"])
            gone.cancel()
            await until(lambda: server.protocols and server.protocols[0].pending)
            server.protocols[0].answer()
            resp = await first
            await until(lambda: resp.is_complete)
            assert await resp.aread() == b"done"  # no await inside: the connection is handed to `handed` here,
            handed.cancel()  # and `handed` is cancelled before it runs again
            await until(lambda: server.protocols[0].pending)
            server.protocols[0].answer()
            assert await (await last).aread() == b"done"
            assert gone.cancelled() and handed.cancelled() and pool.num_open(url) == 1
            pool.close()
        return server, log

    server, log = run(main())
    assert len(server.protocols) == 1 and log == [b"first", b"last"]


def test_no_bound_opens_a_connection_per_concurrent_request():
    async def main():
        log: list[bytes] = []
        server = Server(lambda: Held(log))
        async with server as url:
            pool = UpstreamPool(connect_timeout_s=5)
            tasks = await send_all(pool, url, [b"r%d" % i for i in range(5)])
            await until(lambda: sum(p.pending for p in server.protocols) == 5)
            for proto in server.protocols:
                proto.answer()
            for task in tasks:
                await (await task).aread()
            assert pool.queued_total == 0 and pool.num_open(url) == 5
            pool.close()
        return server

    assert len(run(main()).protocols) == 5


def test_router_setting_bounds_the_legs_pool():
    from router.app import create_app  # noqa: PLC0415
    from router.settings import Settings  # noqa: PLC0415
    from tests.conftest import free_port  # noqa: PLC0415

    async def main():
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the start-up health round fails fast
        app = create_app(Settings(prefill_urls=[url], decode_urls=[url], upstream_max_connections=3,
                                  health_interval_s=3600.0))
        async with app.router.lifespan_context(app):
            pool = app.state.router.upstream
            assert isinstance(pool, UpstreamPool) and pool.max_connections_per_origin == 3

    run(main())
