"""The router's HTTP/1.1 server (router/server.py, router/connection.py) on raw sockets: keep-alive and pipelining,
HEAD, `Expect: 100-continue`, upgrades, body limits, chunked request bodies, connection: close, malformed
requests, and the ASGI bridge for the non-hot routes. (Streaming and disconnects: test_relay_server.py; timeouts
and limits: test_server_limits.py.)"""

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


def connect(url: str, timeout_s: float = 30.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    """Read until `marker` is in what arrived (AssertionError if the server closes first)."""
    while marker not in data:
        part = sock.recv(65536)
        assert part, f"closed before {marker!r}; got {data[-300:]!r}"
        data += part
    return data


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while part := sock.recv(65536):
        out += part
    return out


def split_head(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, what follows the head) of the answer at the start of `data`."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def raw(url: str, data: bytes, timeout_s: float = 30.0) -> bytes:
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


def test_head_answers_the_get_head_without_a_body(router):
    """HEAD /health and HEAD of a route only POST serves: GET's status and headers, no body, so the next answer on
    the connection starts right after the head."""
    get_health = httpx.get(f"{router}/health", timeout=30)
    out = raw(router, b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\nHEAD /v1/completions HTTP/1.1\r\nHost: r\r\n\r\n"
                      b"GET /livez HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
    status, headers, rest = split_head(out)
    assert status == 200 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(get_health.content) > 0
    status, headers, rest = split_head(rest)  # no body came between the two heads
    assert status == httpx.get(f"{router}/v1/completions", timeout=30).status_code == 404
    assert int(headers["content-length"]) > 0
    status, _, body = split_head(rest)
    assert status == 200 and json.loads(body) == {"status": "alive"}


def test_pipelined_stream_then_requests_keep_their_order(router):
    """A stream, a HEAD and a completion sent together: each answer whole and in order on one connection."""
    stream = json.dumps(completion(stream=True)).encode()
    out = raw(router, post("/v1/completions", stream) + b"HEAD /livez HTTP/1.1\r\nHost: r\r\n\r\n"
              + post("/v1/completions", json.dumps(completion()).encode(), b"Connection: close\r\n"))
    status, headers, rest = split_head(out)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    events, _, rest = rest.partition(b"0\r\n\r\n")  # the stream's last chunk
    assert events.count(b"data: {") == 4 and b"data: [DONE]" in events
    status, headers, rest = split_head(rest)
    assert status == 200 and headers["content-length"] != "0"
    status, _, body = split_head(rest)
    assert status == 200 and json.loads(body)["choices"][0]["text"]


def test_100_continue_comes_before_the_body_is_sent(router):
    body = json.dumps(completion()).encode()
    with connect(router) as sock:
        sock.sendall(post("/v1/completions", b"", b"Expect: 100-continue\r\nConnection: close\r\n")
                     .replace(b"Content-Length: 0", b"Content-Length: %d" % len(body)))
        assert read_until(sock, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # the body is not sent yet
        sock.sendall(body)
        status, _, answer = split_head(read_all(sock))
    assert status == 200 and json.loads(answer)["choices"][0]["text"]


def test_expect_with_a_body_over_the_limit_is_refused_unread(router):
    """413 answers the head (no 100 Continue), and the connection closes: the body is never asked for."""
    with connect(router) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        out = read_all(sock)  # ends: the server closed the connection without the body
    status, headers, body = split_head(out)
    assert status == 413 and headers["connection"] == "close" and b"100 Continue" not in out
    assert json.loads(body)["error"]["code"] == 413


def test_100_continue_waits_for_the_answers_before_it(router):
    """Behind a pipelined stream, `100 Continue` comes after that stream's last chunk, never inside it."""
    stream = json.dumps(completion(stream=True)).encode()
    body = json.dumps(completion()).encode()
    with connect(router) as sock:
        sock.sendall(post("/v1/completions", stream) + b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n" % len(body))
        first = read_until(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        out = first + read_all(sock)
    assert out.index(b"0\r\n\r\nHTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") > out.index(b"data: [DONE]")


def test_upgrade_is_ignored_and_the_connection_stays_http11(router):
    """A WebSocket upgrade is answered as the plain request it is (never 101), and the next request on the
    connection is answered too (RFC 9110 7.8: a server may ignore Upgrade)."""
    out = raw(router, b"GET /livez HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                      b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                      + post("/v1/completions", json.dumps(completion()).encode(), b"Connection: close\r\n"))
    status, headers, rest = split_head(out)
    assert status == 200 and "upgrade" not in headers
    body, rest = rest[:int(headers["content-length"])], rest[int(headers["content-length"]):]
    assert json.loads(body) == {"status": "alive"}
    status, _, answer = split_head(rest)
    assert status == 200 and json.loads(answer)["choices"][0]["text"]


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
     b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 405),
], ids=["upgrade-with-body", "connect"])
def test_upgrades_that_cannot_be_ignored_are_refused_and_closed(router, request_bytes, status):
    with connect(router) as sock:
        sock.sendall(request_bytes)
        got, headers, body = split_head(read_all(sock))  # returns: the server closes the connection
    assert got == status and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == status
