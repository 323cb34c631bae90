"""The floor for a PD router in Python: two legs per request and nothing else (benchmark contender `floor`).

Per request: parse the client's POST (httptools), send the P leg (`kv_transfer_params.do_remote_decode`,
max_tokens 1) through the router's own keep-alive pool (router/upstream.py), send the D leg with P's handoff,
answer D's body (or relay D's stream chunk by chunk). No placement, sessions, breakers, timeouts, metrics, validation or error handling: what is
left of our router's cost once its features are taken away. Not a router to run; benchmarks/router.py starts it
with `--only floor`.

    python benchmarks/router_floor.py --port 18500 --prefill URL --decode URL [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import httptools
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from router.upstream import UpstreamPool  # noqa: E402


class FloorConnection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, prefill: str, decode: str) -> None:
        self.pool, self.prefill, self.decode = pool, prefill, decode
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        raw, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self.answer(raw))

    async def answer(self, raw: bytes) -> None:
        request = orjson.loads(raw)
        p_body = {**request, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1, "stream": False}
        resp = await self.pool.send(self.prefill, "/v1/completions", orjson.dumps(p_body), {"X-Request-Id": "r"})
        handoff = orjson.loads(await resp.aread()).get("kv_transfer_params")
        resp = await self.pool.send(self.decode, "/v1/completions",
                                    orjson.dumps({**request, "kv_transfer_params": handoff}), {"X-Request-Id": "r"})
        if not request.get("stream"):
            content = await resp.aread()
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(content), content))
            return
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        async for chunk in resp.aiter_raw():  # D's bytes as they come (no accounting)
            self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.transport.write(b"0\r\n\r\n")


async def serve(port: int, prefill: str, decode: str) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    pool = UpstreamPool(5.0)
    await asyncio.get_running_loop().create_server(lambda: FloorConnection(pool, prefill, decode), sock=sock)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    children = []
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            uvloop.run(serve(args.port, args.prefill, args.decode))
            return
        children.append(pid)
    signal.signal(signal.SIGTERM, lambda *_: ([os.kill(pid, signal.SIGKILL) for pid in children], os._exit(0)))
    uvloop.run(serve(args.port, args.prefill, args.decode))


if __name__ == "__main__":
    main()
