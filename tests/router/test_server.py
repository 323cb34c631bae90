"""The router's own HTTP/1.1 server (router/server.py) on raw sockets: keep-alive and pipelining, 100-continue,
body limits, chunked request bodies, connection: close, malformed requests, and the ASGI bridge for the
non-hot routes. (Streaming, disconnects and timeouts run under this server in test_relay_uvicorn.py.)"""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack

import httpx
import pytest

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.settings import Settings
from tests.router.fakes import FakeNode
from tests.router.harness import chat, completion
from tests.router.servers import router_server, uvicorn_server

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def router():
    nodes = [FakeNode("p0", "prefill"), FakeNode("d0", "decode")]
    with ExitStack() as stack:
        urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in nodes}
        config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
            InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine="vllm") for n in nodes])
        settings = Settings(health_interval_s=3600.0, disagg_min_uncached_tokens=1, max_body_bytes=4096,
                            admin_token="t")
        yield stack.enter_context(router_server(create_app(settings, config=config)))


def raw(url: str, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `data` on one connection and read until the server closes it (the last request of `data`
    carries `Connection: close`)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        out = b""
        while part := sock.recv(65536):
            out += part
        return out


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def test_pipelined_requests_are_answered_in_order_on_one_connection(router):
    one = json.dumps(completion()).encode()
    two = json.dumps(chat()).encode()
    out = raw(router, post("/v1/completions", one) + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
              + post("/v1/chat/completions", two, b"Connection: close\r\n"))
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b'"text"') < out.index(b"decode_instances") < out.index(b'"message"')


def test_expect_100_continue_and_connection_close(router):
    body = json.dumps(completion()).encode()
    out = raw(router, post("/v1/completions", body, b"Expect: 100-continue\r\nConnection: close\r\n"))
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert b"connection: close" in out.lower()


def test_body_over_the_limit_is_refused_without_reading_it(router):
    out = raw(router, post("/v1/completions", b"x" * 5000, b"Connection: close\r\n"))
    assert out.startswith(b"HTTP/1.1 413") and b"limit of 4096" in out
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"800\r\n" + b"y" * 0x800 + b"\r\n" for _ in range(3)) + b"0\r\n\r\n")
    assert raw(router, chunked).startswith(b"HTTP/1.1 413")


def test_chunked_request_body_is_read_whole(router):
    body = json.dumps(completion()).encode()
    half = len(body) // 2
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
    out = raw(router, chunked)
    assert out.startswith(b"HTTP/1.1 200 OK") and b"t3 " in out


def test_malformed_request_answers_400_and_closes(router):
    out = raw(router, b"NOT-HTTP\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400") and b"malformed HTTP request" in out


def test_other_routes_go_through_fastapi(router):
    assert httpx.get(f"{router}/livez").json() == {"status": "alive"}
    missing = httpx.get(f"{router}/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert httpx.get(f"{router}/v1/pools").status_code == 401
    pools = httpx.get(f"{router}/v1/pools", headers={"Authorization": "Bearer t"})
    assert pools.status_code == 200 and [p["name"] for p in pools.json()["pools"]] == ["default"]
    assert "pdcluster_router_overhead_seconds_bucket" in httpx.get(f"{router}/metrics").text
    wrong = httpx.post(f"{router}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
