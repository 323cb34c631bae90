"""In-process router + fake nodes: `RouterHarness` runs the app's lifespan and an httpx client on it."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
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
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            yield client, app


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def completion(prompt: str = "hello world, this is a prompt", **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 4, **extra}


def chat(content: str = "hello there, how are you today?", **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
