"""Protocol hygiene of the router's server (router/server.py, router/connection.py, router/validation.py) against
hostile clients: JSON nested past what the legs can send on, NUL outside text for the model (a name, id, control field or header)
and lone surrogates get an OpenAI 400 (not a 500), NUL in a prompt or message content is passed on; a refused `HEAD` gets no body; pipelining is bounded (nothing is parsed past the bound, the socket is
not read); a request head must arrive within `head_read_timeout_s`, a new connection must
send a request within it, and blank lines are no keep-alive activity (slowloris)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from contextlib import ExitStack

import pytest

from router.connection import Connection
from router.server import SWEEP_S, serving
from router.validation import MAX_JSON_DEPTH
from tests.router.fakes import FakeNode
from tests.router.harness import completion
from tests.router.test_edge_errors_server import assert_openai_error, exchange, request
from tests.router.test_server_limits import connect, read_all, start

pytestmark = pytest.mark.process


def nested(depth: int) -> bytes:
    """A completion body whose deepest value sits `depth` levels down (the body itself is level 1)."""
    inner = depth - 1
    return b'{"model": "fake-model", "prompt": "x", "max_tokens": 2, "metadata": ' + b"[" * inner + b"]" * inner + b"}"


def test_json_nesting_past_the_limit_is_a_400_not_a_500():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")])
        for depth in (MAX_JSON_DEPTH + 1, 300, 1000):
            error = assert_openai_error(exchange(router, request("POST", "/v1/completions", nested(depth))), 400)
            assert "nested more than" in error["message"]
        status, _, body = exchange(router, request("POST", "/v1/completions", nested(MAX_JSON_DEPTH)))
        assert status == 200, body


NUL_REFUSED = {
    "key": b'{"model": "fake-model", "prompt": "x", "max_tokens": 2, "metadata": {"k\\u0000": "v"}}',
    "model": b'{"model": "fake-model\\u0000", "prompt": "x", "max_tokens": 2}',
    "user": b'{"model": "fake-model", "prompt": "x", "max_tokens": 2, "user": "\\u0000"}',
    "cache_salt": b'{"model": "fake-model", "prompt": "x", "max_tokens": 2, "cache_salt": "s\\u0000"}',
    "stop": b'{"model": "fake-model", "prompt": "x", "max_tokens": 2, "stop": ["\\u0000"]}',
    "response_format": b'{"model": "fake-model", "prompt": "x", "response_format": {"type": "\\u0000"}}',
    "messages": b'{"model": "fake-model", "messages": [{"role": "user", "name": "n\\u0000", "content": "x"}]}',
}


@pytest.mark.parametrize("name", list(NUL_REFUSED))
def test_nul_outside_model_text_is_a_400(name):
    body = NUL_REFUSED[name]
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")])
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        error = assert_openai_error(exchange(router, request("POST", path, body)), 400)
        assert "NUL" in error["message"] and error["param"] == {"key": "metadata"}.get(name, name)
        escaped = b'{"model": "fake-model", "prompt": "a", "user": "a\\\\u0000b", "max_tokens": 2}'  # \, then text
        assert exchange(router, request("POST", "/v1/completions", escaped))[0] == 200


NUL_ACCEPTED = {
    "prompt": b'{"model": "fake-model", "prompt": "a\\u0000b", "max_tokens": 2}',
    "prompt-list": b'{"model": "fake-model", "prompt": ["a\\u0000b"], "max_tokens": 2}',
    "content-part": b'{"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", '
                    b'"text": "\\u0000"}]}]}',
    "answer-sent-back": b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                        b'"content": "a\\u0000b", "tool_calls": [{"id": "c1", "type": "function", "function": '
                        b'{"name": "f", "arguments": "{\\"x\\": \\"\\u0000\\"}"}}]}, {"role": "user", "content": "more"}]}',
}


@pytest.mark.parametrize("name", list(NUL_ACCEPTED))
def test_nul_in_model_text_is_passed_on(name):
    """A byte-level model may answer byte 0; the client sends that answer back in its next turn: the router passes
    the text on to the node as it came (the node's own rule is the same, serving/json_guard.py)."""
    body = NUL_ACCEPTED[name]
    node = FakeNode("d0", "decode")
    with ExitStack() as stack:
        router = start(stack, [node])
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, _, answer = exchange(router, request("POST", path, body))
        assert status == 200, answer
    sent = json.loads(body)
    received = node.bodies[-1]
    assert received.get("prompt") == sent.get("prompt") and received.get("messages") == sent.get("messages")


def test_nul_in_a_header_is_a_400():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")])
        with connect(router) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\nX-Request-Id: a\x00b\r\n\r\n")
            line, _, body = split_answer(read_all(sock))
        assert line.startswith(b"HTTP/1.1 400") and b"a\x00b" not in body


@pytest.mark.parametrize("prompt", [b'"\\ud800"', b'"x\\udc00"', b'"\xed\xa0\x80"'],
                         ids=["high-escaped", "low-escaped", "raw-bytes"])
def test_lone_surrogate_is_a_400(prompt):
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")])
        body = b'{"model": "fake-model", "prompt": ' + prompt + b', "max_tokens": 2}'
        error = assert_openai_error(exchange(router, request("POST", "/v1/completions", body)), 400)
        assert "not valid JSON" in error["message"]


def split_answer(data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0].encode(), {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}, \
        rest


@pytest.mark.parametrize("sent, status", [
    (b"HEAD /health HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n", b"431"),
    (b"HEAD /health HTTP/1.1\r\nHost: r\r\nX-Slow", b"408"),
], ids=["oversized-head", "slow-head"])
def test_a_refused_head_gets_no_body(sent, status):
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], max_header_bytes=4096, head_read_timeout_s=1.0)
        with connect(router) as sock:
            sock.sendall(sent)
            line, headers, rest = split_answer(read_all(sock))
        assert line.startswith(b"HTTP/1.1 " + status) and int(headers["content-length"]) > 0
        assert rest == b"", f"a HEAD answer has no body, got {rest[:80]!r}"


def livez(num: int) -> bytes:
    return b"GET /livez HTTP/1.1\r\nHost: r\r\n\r\n" * num


@pytest.mark.parametrize("burst", [True, False], ids=["one-write", "write-by-write"])
def test_pipelined_requests_are_parsed_no_further_than_the_bound(burst):
    """In process (the test watches the connection's queue): a slow request, then 12 pipelined ones (with bodies
    and without), in one write or one by one. At most `max_pipelined_requests` are ever received and waiting, the
    rest stays unparsed (held, the socket not read) until their turn nears, and every one is answered in order."""
    from router.app import create_app  # noqa: PLC0415
    from router.config import InstanceSpec, PoolSpec, RouterConfig  # noqa: PLC0415
    from router.settings import Settings  # noqa: PLC0415
    from tests.router.fakes import MultiHostTransport  # noqa: PLC0415

    d0 = FakeNode("d0", "decode", delay_s=1.0)
    config = RouterConfig(pools=[PoolSpec(name="default")],
                          instances=[InstanceSpec(name="d0", role="decode", url="http://d0.test:80", engine="vllm")])
    app = create_app(Settings(health_interval_s=3600.0, max_pipelined_requests=3), config=config,
                     transport=MultiHostTransport({"d0.test:80": d0.app()}))
    slow = json.dumps(completion()).encode()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" \
        % (len(slow), slow)
    followers = [livez(1) if i % 3 else b"POST /livez HTTP/1.1\r\nHost: r\r\nContent-Length: 8\r\n\r\n\r\n\r\n\r\nab"
                 for i in range(12)]

    async def main():
        async with serving(app, graceful_s=5.0) as server:
            client_end, server_end = socket.socketpair()
            await asyncio.get_running_loop().connect_accepted_socket(lambda: Connection(server), server_end)
            reader, writer = await asyncio.open_connection(sock=client_end)
            (conn,) = server.connections
            peaks, queue = [], conn._queue

            def watched(request):
                queue(request)
                peaks.append(len(conn.pending))
            conn._queue = watched
            writer.write(post)
            await asyncio.sleep(0.2)
            was_held = False
            for part in ([b"".join(followers)] if burst else followers):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.05)
                was_held = was_held or (bool(conn.held) and conn.is_reading_paused)
            out = b""
            while out.count(b"HTTP/1.1 ") < 13:
                part = await asyncio.wait_for(reader.read(65536), 30)
                assert part, out
                out += part
            writer.close()
            return max(peaks), was_held, out

    most, was_held, out = asyncio.run(main())
    assert most <= 3 and was_held, (most, was_held)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", out)
    assert statuses[0] == b"200" and len(statuses) == 13, statuses
    assert statuses[1:] == [b"200" if i % 3 else b"405" for i in range(12)], statuses


def test_a_slow_head_gets_408_within_the_head_timeout():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], head_read_timeout_s=1.0, body_read_timeout_s=30.0)
        with connect(router) as sock:
            sent = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: a")
            answer = read_all(sock)
            waited = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 408 ") and b"head not received within" in answer
        assert 1.0 <= waited < 1.0 + SWEEP_S + 5.0, waited


def test_a_body_keeps_the_longer_body_timeout():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], head_read_timeout_s=1.0, body_read_timeout_s=3.0)
        with connect(router) as sock:
            sent = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 50\r\n\r\n{")
            answer = read_all(sock)
            waited = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request not received within 3.0 s" in answer
        assert waited >= 3.0, waited


def test_a_new_connection_that_sends_nothing_is_closed_within_the_head_timeout():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], head_read_timeout_s=1.0, keep_alive_s=75.0)
        with connect(router) as sock:
            opened = time.monotonic()
            assert read_all(sock) == b""
            waited = time.monotonic() - opened
        assert waited < 1.0 + SWEEP_S + 5.0, waited


def test_blank_lines_do_not_keep_a_connection_alive():
    with ExitStack() as stack:
        router = start(stack, [FakeNode("d0", "decode")], keep_alive_s=2.0, head_read_timeout_s=2.0)
        with connect(router, timeout_s=1.0) as sock:
            sock.sendall(livez(1))
            assert b"200 OK" in sock.recv(65536)
            deadline = time.monotonic() + 15.0
            closed = False
            while time.monotonic() < deadline and not closed:
                try:
                    sock.sendall(b"\r\n")
                    closed = sock.recv(100) == b""
                except socket.timeout:
                    continue
                except OSError:
                    closed = True
            assert closed, "a client sending blank lines kept its connection past keep_alive_s"
