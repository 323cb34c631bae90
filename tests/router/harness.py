"""In-process router + fake nodes: `router_harness` serves the app with the router's own server (router/server.py,
what `pdcluster router` runs) and yields an httpx client on it; the router's legs go to in-process fake nodes.

No port: each connection the client opens is one end of a socketpair whose other end the server accepts, so
the requests cross the server's real HTTP/1.1 parsing and writing (router/connection.py) and the tests stay in
the fast tier (no listening socket, tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager

import httpcore
import httpx

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.connection import Connection
from router.server import RouterServer, serving
from router.settings import Settings
from tests.router.fakes import FakeNode, MultiHostTransport

TOKEN = "test-admin-token"


def node_url(node: FakeNode) -> str:
    return f"http://{node.name}.test:80"


@asynccontextmanager
async def router_harness(nodes: list[FakeNode], pools: list[PoolSpec] | None = None,
                         specs: dict[str, dict] | None = None, **overrides):
    """Yield (client, app) for a router in front of `nodes` (engine vllm unless a spec says otherwise)."""
    specs = specs or {}
    instances = [InstanceSpec(name=n.name, role=n.role, url=node_url(n),
                              **{"engine": "vllm", "pool": "default", **specs.get(n.name, {})}) for n in nodes]
    config = RouterConfig(pools=pools or [PoolSpec(name="default", kind="tp")], instances=instances)
    settings = Settings(**{"admin_token": TOKEN, "health_interval_s": 3600.0, "disagg_min_uncached_tokens": 1,
                           "breaker_recovery_s": 3600.0, **overrides})
    transport = MultiHostTransport({f"{n.name}.test:80": n.app() for n in nodes})
    app = create_app(settings, config=config, transport=transport)
    app.state.transport = transport  # tests refuse connections to a node through it
    async with serving(app, graceful_s=5.0) as server, \
            httpx.AsyncClient(transport=in_process_transport(server), base_url="http://router", timeout=30.0) as client:
        yield client, app


class _PairStream(httpcore.AsyncNetworkStream):
    """The client's end of one socketpair (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"no answer within {timeout} s") from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writer.write(buffer)
        await self.writer.drain()

    async def aclose(self) -> None:
        self.writer.close()

    def get_extra_info(self, info: str) -> None:
        return None


class _ServerBackend(httpcore.AsyncNetworkBackend):
    """Connects the client to `server` over a fresh socketpair per connection."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> _PairStream:
        client_end, server_end = socket.socketpair()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: Connection(self.server), server_end)
        return _PairStream(*await asyncio.open_connection(sock=client_end))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def in_process_transport(server: RouterServer) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections reach `server` without a port."""
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(network_backend=_ServerBackend(server))  # httpx takes no backend
    return transport


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def completion(prompt: str = "hello world, this is a prompt", **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 4, **extra}


def chat(content: str = "hello there, how are you today?", **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
