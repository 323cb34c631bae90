"""Every error of the router's HTTP server (router/server.py, what `pdcluster router` runs) is OpenAI JSON: huge
numeric headers, bad URLs and methods, deeply nested or malformed JSON, an unexpected exception on the hot path,
on an ASGI route or in the server itself (no traceback, no internal address in the answer); one that strikes
after the answer began ends the connection instead."""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack

import pytest

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.settings import Settings
from tests.router.fakes import FakeNode
from tests.router.harness import completion
from tests.router.servers import router_server, uvicorn_server

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def router():
    nodes = [FakeNode("p0", "prefill"), FakeNode("d0", "decode")]
    with ExitStack() as stack:
        urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in nodes}
        config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
            InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine="vllm") for n in nodes])
        settings = Settings(health_interval_s=3600.0, disagg_min_uncached_tokens=1, max_body_bytes=1 << 20)
        yield stack.enter_context(router_server(create_app(settings, config=config)))


def exchange(url: str, data: bytes, timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection (`Connection: close`): status, headers, body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        out = b""
        while part := sock.recv(65536):
            out += part
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return int(lines[0].split()[1]), headers, body


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def request(method: str, path: str, body: bytes = b"", headers: bytes = b"") -> bytes:
    return (b"%s %s HTTP/1.1\r\nHost: r\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n%s" % (method.encode(), path.encode(), len(body), headers, body))


def assert_openai_error(answer: tuple[int, dict[str, str], bytes], status: int) -> dict:
    got, headers, body = answer
    assert got == status, body
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert b"Traceback" not in body
    return error


BODY = json.dumps(completion()).encode()


def test_a_5000_digit_numeric_header_is_a_400(router):
    error = assert_openai_error(exchange(router, request("POST", "/v1/completions", BODY,
                                                         b"X-Expected-Context-Tokens: " + b"9" * 5000 + b"\r\n")), 400)
    assert error["param"].lower() == "x-expected-context-tokens"
    assert_openai_error(exchange(router, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
                                         b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n" + BODY), 400)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("POST", "/v1/completions/x", 404),
                                                ("GET", "/v1/completions", 404), ("DELETE", "/v1/models", 405),
                                                ("GET", "/%ff%fe", 404)],
                         ids=["unknown", "below-completions", "get-completions", "delete-models", "bad-bytes"])
def test_bad_urls_and_methods(router, method, path, status):
    assert_openai_error(exchange(router, request(method, path)), status)


@pytest.mark.parametrize("depth", [1100, 100_000])
def test_deeply_nested_json(router, depth):
    body = b'{"model": "fake-model", "prompt": "x", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    assert_openai_error(exchange(router, request("POST", "/v1/completions", body)), 400)


def test_huge_integer_in_the_body(router):
    body = b'{"model": "fake-model", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_openai_error(exchange(router, request("POST", "/v1/completions", body)), 400)


def test_unexpected_exceptions_are_clean_500s(router, monkeypatch):
    def boom(*_args, **_kwargs):
        raise RuntimeError("lease 3f2a9c0d1e2b4a5f9c8d7e6f5a4b3c2d at 10.1.2.3:5600 broke")

    monkeypatch.setattr("router.service._context", boom)
    hot = assert_openai_error(exchange(router, request("POST", "/v1/completions", BODY)), 500)
    monkeypatch.setattr("router.registry.Registry.served_models", boom)
    routed = assert_openai_error(exchange(router, request("GET", "/v1/models")), 500)
    for error in (hot, routed):
        assert "10.1.2.3" not in error["message"] and "3f2a9c0d" not in error["message"]
    monkeypatch.undo()
    status, _, _ = exchange(router, request("POST", "/v1/completions", BODY))
    assert status == 200, "the router keeps serving"


def test_errors_past_the_app_reach_the_one_catch_all(router, monkeypatch):
    """The server's own catch-all (RouterServer.dispatch): a failure around the FastAPI app is a clean 500; one
    after an answer's head was written closes the connection without a second answer."""
    async def broken_bridge(*_args, **_kwargs):
        raise RuntimeError("bridge at 10.1.2.3:5600 broke")

    monkeypatch.setattr("router.server.call_asgi", broken_bridge)
    error = assert_openai_error(exchange(router, request("GET", "/livez")), 500)
    assert "10.1.2.3" not in error["message"]

    async def head_then_fail(self, conn, reply, is_keep_alive):
        conn.write(self.head(reply, is_keep_alive, None))
        raise RuntimeError("after the head")

    monkeypatch.setattr("router.server.RouterServer.write_reply", head_then_fail)
    status, headers, body = exchange(router, request("POST", "/v1/completions", BODY))
    assert status == 200 and headers["transfer-encoding"] == "chunked" and b"HTTP/1.1 500" not in body
    monkeypatch.undo()
    assert exchange(router, request("POST", "/v1/completions", BODY))[0] == 200, "the router keeps serving"
