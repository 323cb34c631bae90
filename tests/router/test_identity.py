"""Client identity and limits (router/identity.py): API keys, session ids scoped per key and hashed, bounds on
what reaches a parser; and, against a real `pdcluster router` process, 8 MB session ids answered 400 while
the router's memory stays flat."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from router.identity import ANONYMOUS, MAX_SESSION_ID_BYTES, APIKeys, session_key
from serving.errors import APIError
from tests.conftest import REPO_ROOT, free_port
from tests.router.fakes import FakeNode
from tests.router.harness import chat, completion, router_harness
from tests.router.servers import wait_until


def run(coro):
    return asyncio.run(coro)


def test_keys_from_inline_and_file(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nk-file-1\n\n  k-file-2  \n")
    keys = APIKeys.from_settings("k-a, k-b", str(keys_file))
    tenants = {keys.tenant(f"Bearer {k}") for k in ("k-a", "k-b", "k-file-1", "k-file-2")}
    assert len(tenants) == 4 and all(len(t) == 16 for t in tenants)
    assert keys.tenant("bearer k-a") == keys.tenant("Bearer   k-a")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", "Basic k-a", "Bearer " + "k" * 5000])
def test_missing_or_wrong_keys_are_401(header):
    with pytest.raises(APIError) as err:
        APIKeys(["k-a"]).tenant(header)
    assert err.value.status == 401


def test_no_keys_means_one_anonymous_tenant():
    assert APIKeys([]).tenant(None) == ANONYMOUS == APIKeys([]).tenant("Bearer anything")


def test_session_keys_are_fixed_size_hashes_scoped_by_tenant():
    a = session_key("t1", {"x-session-id": "s"}, {})
    assert len(a) == 32 and a == session_key("t1", {}, {"user": "s"})
    assert a != session_key("t2", {"x-session-id": "s"}, {})
    assert session_key("t1", {}, {}) is None and session_key("t1", {}, {"user": ""}) is None
    assert session_key("t1", {"x-session-id": "h"}, {"user": "u"}) == session_key("t1", {"x-session-id": "h"}, {})
    assert len(session_key("t1", {}, {"user": "é" * 64})) == 32  # 128 bytes: the limit itself


@pytest.mark.parametrize("headers,body,param", [
    ({"x-session-id": "s" * (MAX_SESSION_ID_BYTES + 1)}, {}, "X-Session-ID"),
    ({}, {"user": "é" * 65}, "user"),
    ({}, {"user": ["list"]}, "user"),
])
def test_session_ids_past_the_limit_are_400(headers, body, param):
    with pytest.raises(APIError) as err:
        session_key("t", headers, body)
    assert (err.value.status, err.value.param) == (400, param)


def test_router_with_keys():
    async def main():
        async with router_harness([FakeNode("prefill-0", "prefill"), FakeNode("decode-0", "decode")],
                                  api_keys="good-key") as (client, _):
            for headers in ({}, {"Authorization": "Bearer bad"}):
                resp = await client.post("/v1/chat/completions", json=chat(), headers=headers)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
                assert (await client.get("/v1/models", headers=headers)).status_code == 401
            ok = await client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer good-key"})
            assert ok.status_code == 200
            models = await client.get("/v1/models", headers={"Authorization": "Bearer good-key"})
            assert models.status_code == 200
            assert (await client.get("/health")).status_code == 200, "probes need no key"

    run(main())


def test_router_bounds_session_ids_and_the_context_hint():
    async def main():
        async with router_harness([FakeNode("prefill-0", "prefill"), FakeNode("decode-0", "decode")]) as (client, _):
            cases = [({"X-Session-ID": "x" * 129}, completion(), "X-Session-ID"),
                     ({}, completion(user="u" * 129), "user"),
                     ({"X-Expected-Context-Tokens": "9" * 5000}, completion(), "X-Expected-Context-Tokens"),
                     ({"X-Expected-Context-Tokens": "-5"}, completion(), "X-Expected-Context-Tokens")]
            for headers, body, param in cases:
                resp = await client.post("/v1/completions", json=body, headers=headers)
                assert resp.status_code == 400, (param, resp.text)
                assert resp.json()["error"]["param"] == param
            ok = await client.post("/v1/completions", json=completion(), headers={"X-Session-ID": "x" * 128,
                                                                                   "X-Expected-Context-Tokens": "4096"})
            assert ok.status_code == 200

    run(main())


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total


def _router_pids(pid: int) -> list[int]:
    from cluster.process import descendants  # noqa: PLC0415

    return [pid, *descendants(pid)]


def _response(data: bytes) -> tuple[int, bytes] | None:
    """The (status, body) of a whole content-length framed response in `data`; None while it is incomplete."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return (int(head.split(b" ")[1]), body[:length]) if len(body) >= length else None


def _send(sock: socket.socket, request: bytes) -> tuple[int, bytes, int]:
    """Send one request while watching for its answer, as HTTP clients do: a server may answer before the request
    is sent whole (the router refuses a head past its header limit at once and reads no further), and then the
    rest is not sent. (status, body, bytes sent)."""
    data, sent, deadline = b"", 0, time.monotonic() + 60
    while (response := _response(data)) is None:
        assert time.monotonic() < deadline, f"no answer within 60 s ({sent} bytes sent)"
        sending = not data and sent < len(request)  # once the answer begins, nothing more is sent
        readable, writable, _ = select.select([sock], [sock] if sending else [], [], 1.0)
        if readable:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a whole response: {data[:200]!r}")
            data += chunk
        elif writable:
            sent += sock.send(request[sent:sent + (1 << 16)])
    return *response, sent


@pytest.mark.process
def test_8mb_session_ids_get_400_and_router_memory_stays_flat():
    """1,000 requests with an 8 MB X-Session-ID against `pdcluster router --workers 2` (its own HTTP server).
    Each is refused with OpenAI JSON (431 when the header block passes the server's `max_header_bytes`, 400
    from the session-id bound below it); the resident memory of the router's processes, measured after 20
    warm-up requests (allocator arenas), grows by less than 50 MB over the 1,000. The router answers a head past
    its limit without reading the rest, so the client (which reads while it sends) never sends most of the 8 MB."""
    ports = [free_port() for _ in range(3)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ROUTER_DISAGG_MIN_UNCACHED_TOKENS": "1"}
    fakes = subprocess.Popen([sys.executable, "-m", "tests.router.wire_fake", "--ports", *map(str, ports[1:])],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    router = None
    try:
        assert fakes.stdout.readline().strip() == "ready"
        p, d = (f"http://127.0.0.1:{port}" for port in ports[1:])
        router = subprocess.Popen([sys.executable, "-c", "import sys; from router.cli import main; "
                                   "sys.exit(main(sys.argv[1:]))", "--prefill", p, "--decode", d, "--engine", "vllm",
                                   "--port", str(ports[0]), "--workers", "2", "--log-level", "warning"],
                                  cwd=REPO_ROOT, env=env)
        url = f"http://127.0.0.1:{ports[0]}"

        def serves() -> bool:
            try:
                return httpx.post(f"{url}/v1/completions", json=completion(), timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(serves, 90.0, 0.2), "router did not come up"
        body = orjson.dumps(completion())
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                   b"x-session-id: " + b"s" * (8 << 20) + b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        statuses: dict[int, int] = {}
        baseline, most_sent = None, 0
        for i in range(1_020):
            if i == 20:
                time.sleep(1.0)
                baseline = _rss_kib(_router_pids(router.pid))
            with socket.socket() as sock:  # a refusal closes the connection: one each
                # a send buffer of 256 KiB, not the few MB Linux grows it to: what a refusal costs is then what
                # the router reads, not what the kernel holds in flight
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 << 10)
                sock.settimeout(60)
                sock.connect(("127.0.0.1", ports[0]))
                status, answer, sent = _send(sock, request)
            most_sent = max(most_sent, sent)
            statuses[status] = statuses.get(status, 0) + 1
            error = orjson.loads(answer)["error"]
            assert status in (400, 431) and error["code"] == status, (status, answer[:300])
        time.sleep(1.0)
        grown_mib = (_rss_kib(_router_pids(router.pid)) - baseline) / 1024
        print(f"router RSS growth over 1,000 8 MB session ids: {grown_mib:.1f} MiB; statuses {statuses}; "
              f"at most {most_sent >> 10} KiB sent of one")
        assert most_sent < len(request) // 2, f"the router read {most_sent >> 20} MiB of a refused head before answering"
        assert grown_mib < 50, f"router RSS grew by {grown_mib:.1f} MiB over 1,000 8 MB session ids ({statuses})"
        assert serves(), "the router still serves"
        # under the server's header limit the router's own bound answers: 400 naming the field
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=60) as conn:
            status, answer, _ = _send(conn, request.replace(b"s" * (8 << 20), b"s" * (32 << 10)))
        assert status == 400 and orjson.loads(answer)["error"]["param"] == "X-Session-ID", answer[:300]
    finally:
        for proc in (router, fakes):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
