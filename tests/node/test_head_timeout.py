"""Request-head deadline on the node's HTTP server (node/serving.py `head_timeout_protocol`): a client that trickles
a request head (slowloris) or opens a connection and sends nothing is cut off after `http_head_timeout_s`, with a
408 OpenAI error when part of a head arrived; a whole request on a kept-alive connection is unaffected, and its
next head has the same deadline. Runs the node's own uvicorn config (`uvicorn_config`) on 127.0.0.1 in a thread:
a real server, no node process (the protocol is what is tested, not an engine)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from node.serving import uvicorn_config
from node.settings import NodeSettings
from tests.conftest import free_port

HEAD_TIMEOUT_S = 1.0
WAIT_S = 30.0
"""How long a test waits for the server to act: generous on a loaded machine; the assertions are on events."""


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server():
    settings = NodeSettings(port=free_port(), host="127.0.0.1", http_head_timeout_s=HEAD_TIMEOUT_S)
    srv = uvicorn.Server(uvicorn_config(_app, settings))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield settings.port
    srv.should_exit = True
    thread.join(timeout=10)


def _trickle(sock: socket.socket, first: bytes) -> bytes:
    """Send `first`, then one header byte every 0.1 s until the server answers or closes; what it sent."""
    sock.sendall(first)
    sock.settimeout(0.1)
    deadline = time.monotonic() + WAIT_S
    received = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            try:
                sock.sendall(b"x")
            except OSError:
                break
            continue
        except OSError:
            break
        if not chunk:
            return received
        received += chunk
    assert received, "the server kept the trickling connection open"
    return received


def test_a_trickled_head_gets_408_and_the_connection_ends(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        answer = _trickle(sock, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == 408


def test_a_silent_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(WAIT_S)
        assert sock.recv(100) == b""


def test_whole_requests_pass_and_the_next_head_has_the_same_deadline(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(WAIT_S)
        for _ in range(2):
            sock.sendall(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc")
            assert sock.recv(65536).split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle between requests: uvicorn's keep-alive timeout, not the head's
        answer = _trickle(sock, b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    assert answer.startswith(b"HTTP/1.1 408")


def test_a_head_h11_refuses_gets_400_as_openai_json(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(WAIT_S)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: a\r\nX-Request-Id: a\x00b\r\nContent-Length: 0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == 400
