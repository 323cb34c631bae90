"""The router's server (router/server.py, router/connection.py) under hostile clients, on real sockets: oversized
headers (431), slow senders of a request line, headers or body (408 within the bound, never inside an answer in
progress), a stalled SSE reader (disconnected, both legs aborted), too many connections (503); and a node whose
`/v1/models` answers `[]` is marked unhealthy while the router keeps serving."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import httpx
import pytest

from router.app import create_app
from router.connection import LINGER_S
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.server import SWEEP_S
from router.settings import Settings
from tests.router.fakes import FakeNode
from tests.router.harness import completion
from tests.router.servers import router_server, uvicorn_server, wait_until

pytestmark = pytest.mark.process
ADMIN = {"Authorization": "Bearer t"}


def start(stack: ExitStack, nodes: list[FakeNode], **overrides) -> str:
    urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in nodes}
    config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
        InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine="vllm") for n in nodes])
    settings = Settings(**{"health_interval_s": 3600.0, "disagg_min_uncached_tokens": 1, "admin_token": "t",
                           **overrides})
    return stack.enter_context(router_server(create_app(settings, config=config)))


def connect(url: str, timeout_s: float = 30.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while part := sock.recv(65536):
        out += part
    return out


def test_oversized_headers_get_431():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], max_header_bytes=4096)
        with connect(router) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 431 ") and b'"error"' in answer
        assert httpx.post(f"{router}/v1/completions", json=completion(), timeout=30).status_code == 200


def test_a_refused_request_is_not_read_to_its_end():
    """Past `max_header_bytes` the router answers 431 and stops reading: a client that goes on sending a 64 MB
    header without reading its answer stalls (TCP pushes back) and the connection closes after LINGER_BYTES (16 MiB)
    more at most, the client's socket buffers (a few MB) aside - the router never takes the 64 MB (it used to go on
    reading the header until httptools ended it)."""
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], max_header_bytes=4096)
        request = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * (64 << 20)
        with connect(router) as sock:
            sock.settimeout(0.2)
            sent, stalled_since = 0, None
            while sent < len(request):
                try:
                    sent += sock.send(request[sent:sent + (1 << 16)])
                    stalled_since = None
                except TimeoutError:  # nothing taken for 0.2 s: the router is not reading
                    stalled_since = stalled_since or time.monotonic()
                    if time.monotonic() - stalled_since > LINGER_S + 5.0:
                        break
                except OSError:  # the router closed the connection (a reset: bytes were still arriving)
                    break
        assert sent < 32 << 20, f"the router took {sent >> 20} MiB of a refused request"


@pytest.mark.parametrize("partial", [
    b"POST /v1/compl",
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Ty",
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\n{\"model\"",
], ids=["request-line", "headers", "body"])
def test_slow_sender_gets_408_within_the_bound(partial):
    """A request that stalls part-way gets 408 and the connection closes, within `body_read_timeout_s` of its
    first byte plus one sweep (SWEEP_S); the margin covers a loaded machine."""
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], body_read_timeout_s=1.0)
        with connect(router) as sock:
            sent = time.monotonic()
            sock.sendall(partial)
            answer = read_all(sock)  # the server answers and closes; the test's own timeout is 30 s
            waited = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within" in answer
        assert b"connection: close" in answer
        assert 1.0 <= waited < 1.0 + SWEEP_S + 5.0, waited


def test_a_partial_request_behind_a_stream_waits_for_its_turn():
    """A partial request pipelined behind a 2.5 s stream gets no 408 inside that stream: its time to arrive counts
    from its turn, then it gets 408."""
    d0 = FakeNode("d0", "decode", num_tokens=5, token_delay_s=0.5)
    with ExitStack() as stack:
        router = start(stack, [d0], body_read_timeout_s=1.0)
        body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 5, "stream": true}'
        with connect(router) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body) + b"POST /v1/compl")
            answer = read_all(sock)
        stream, _, after = answer.partition(b"0\r\n\r\n")
        assert stream.count(b"data: {") == 5 and b"data: [DONE]" in stream and b"408" not in stream
        assert after.startswith(b"HTTP/1.1 408 ")


def test_stalled_stream_reader_is_disconnected_and_legs_aborted():
    d0 = FakeNode("d0", "decode", num_tokens=2000, token_pad=8192)
    with ExitStack() as stack:
        router = start(stack, [d0], write_timeout_s=1.0)
        sock = connect(router)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2000, "stream": true}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            metrics = lambda: httpx.get(f"{router}/metrics", timeout=10).text  # noqa: E731
            assert wait_until(lambda: 'pdcluster_requests_total{outcome="cancelled",pool="default"} 1.0'
                              in metrics(), 60.0)

        finally:
            sock.close()


def test_connections_past_the_limit_get_503():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], max_connections=2)
        held = [connect(router), connect(router)]
        try:
            time.sleep(0.2)  # both accepted before the third arrives
            with connect(router) as extra:
                answer = read_all(extra)
                assert answer.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in answer
        finally:
            for sock in held:
                sock.close()


def test_node_with_empty_model_list_is_unhealthy_while_the_router_serves():
    good, empty = FakeNode("d0", "decode"), FakeNode("d1", "decode", models_body=[])
    with ExitStack() as stack:
        router = start(stack, [good, empty])
        pools = httpx.get(f"{router}/v1/pools", headers=ADMIN, timeout=10).json()
        health = {i["name"]: (i["healthy"], i["last_error"]) for i in pools["instances"]}
        assert health["d0"] == (True, None)
        assert health["d1"][0] is False and "/v1/models" in health["d1"][1]
        assert httpx.get(f"{router}/health", timeout=10).json()["decode_instances"] == ["d0"]
        for _ in range(4):
            resp = httpx.post(f"{router}/v1/completions", json=completion(), timeout=30)
            assert resp.status_code == 200 and resp.headers["x-pdcluster-decode"] == "d0"
        assert empty.bodies == []
