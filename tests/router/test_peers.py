"""Router replicas share admin drains (router/peers.py): two routers on real sockets, each the other's peer.
A drain on one is applied by the other before the call answers; an undrain likewise; a replica that
(re)starts adopts the drains in force on its peers; a peer that is down is reported as `failed`."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.peers import resolve_peers
from router.settings import Settings
from tests.conftest import free_port
from tests.router.fakes import FakeNode
from tests.router.harness import admin_headers, completion, router_harness
from tests.router.servers import router_server, uvicorn_server, wait_until

ADMIN = {"Authorization": "Bearer t"}


def replica(stack: ExitStack, config: RouterConfig, port: int, peers: list[int]) -> str:
    settings = Settings(health_interval_s=3600.0, admin_token="t",
                        peer_urls=[f"http://127.0.0.1:{p}" for p in peers])
    return stack.enter_context(router_server(create_app(settings, config=config), port=port))


def draining(router: str) -> dict[str, bool]:
    pools = httpx.get(f"{router}/v1/pools", headers=ADMIN, timeout=10).json()
    return {i["name"]: i["draining"] for i in pools["instances"]}


def test_resolve_peers_from_static_urls_and_dns():
    settings = Settings(peer_urls=["http://10.0.0.9:8000/"], peer_dns="localhost:8123")
    urls = asyncio.run(resolve_peers(settings))
    assert urls[0] == "http://10.0.0.9:8000" and "http://127.0.0.1:8123" in urls


@pytest.mark.process
def test_drains_reach_every_replica_and_a_restarted_one_adopts_them():
    nodes = [FakeNode("d0", "decode"), FakeNode("d1", "decode")]
    port_a, port_b = free_port(), free_port()
    with ExitStack() as stack:
        urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in nodes}
        config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
            InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine="vllm") for n in nodes])
        a = replica(stack, config, port_a, [port_b])
        with ExitStack() as b_stack:
            b = replica(b_stack, config, port_b, [port_a])
            answer = httpx.post(f"{a}/admin/instances/d0/drain", headers=ADMIN, timeout=10).json()
            assert answer["replicas"] == {"applied": [b], "failed": []}
            assert draining(a)["d0"] and draining(b)["d0"], "the drain holds on both replicas at once"
            for router in (a, b):
                resp = httpx.post(f"{router}/v1/completions", json=completion(), timeout=30)
                assert resp.headers["x-pdcluster-decode"] == "d1"
            httpx.post(f"{b}/admin/instances/d1/drain", headers=ADMIN, timeout=10)
            httpx.post(f"{b}/admin/instances/d0/undrain", headers=ADMIN, timeout=10)
            assert draining(a) == {"d0": False, "d1": True} == draining(b)
        # b is down: a's broadcast says so; b restarts and adopts what a holds
        answer = httpx.post(f"{a}/admin/instances/d0/drain", headers=ADMIN, timeout=10).json()
        assert answer["replicas"] == {"applied": [], "failed": [f"http://127.0.0.1:{port_b}"]}
        b = replica(stack, config, port_b, [port_a])
        assert wait_until(lambda: draining(b) == {"d0": True, "d1": True}, 30.0), draining(b)
        assert httpx.get(f"{b}/admin/drains", headers=ADMIN, timeout=10).json() == {"draining": ["d0", "d1"]}


def test_forwarded_drain_needs_the_admin_token():
    async def main():
        async with router_harness([FakeNode("d0", "decode")]) as (client, _):
            resp = await client.post("/admin/instances/d0/drain", headers={"x-pdcluster-forwarded": "1"})
            assert resp.status_code == 401
            forwarded = {"x-pdcluster-forwarded": "1", **admin_headers()}
            resp = await client.post("/admin/instances/later/drain", headers=forwarded)
            assert resp.status_code == 200, "a forwarded drain of an instance not discovered yet is kept"
            assert (await client.get("/admin/drains", headers=admin_headers())).json() == {"draining": ["later"]}
            resp = await client.post("/admin/instances/later/drain", headers=admin_headers())
            assert resp.status_code == 404, "a direct call names a known instance"

    asyncio.run(main())
