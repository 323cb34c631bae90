"""The upstream pool (router/upstream.py) against real sockets on 127.0.0.1: keep-alive reuse, streamed
bodies, `connection: close`, a reused connection the peer dropped, cancellation and refused connections."""

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
            assert not pool._idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))

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
