"""The reader of every hand-off for one of our decode instances is named (router/readers.py): a decode instance
whose engine id the router has not polled yet (it just started, or came back from unhealthy) has it read on
demand, and one whose id cannot be learned gets no P leg at all; vLLM instances, which report none, stay unbound."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness

OURS = {"engine_label": "reference", "tp_size": 1}
SPECS = {name: {"engine": "reference"} for name in ("p0", "d0")}


async def until_healthy(app, name: str) -> None:
    """Health rounds until `name` is healthy (the harness runs none by itself)."""
    checker, state = app.state.health_checker, app.state.router
    for _ in range(10):
        await checker.check_all()
        if state.registry.get(name).is_healthy:
            return
    raise AssertionError(f"{name} never turned healthy")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_decode_instance_not_polled_yet_has_its_engine_id_read_before_the_prefill_leg(stream):
    """d0 was down when the router started (never polled); once healthy, its first request's P leg names its id,
    and after a restart (unhealthy, then a new id) the new one, never none and never the stale one."""
    p = FakeNode("p0", "prefill", **OURS)
    d0 = FakeNode("d0", "decode", healthy=False, **OURS)

    async def main():
        async with router_harness([p, d0], specs=SPECS) as (client, app):
            state = app.state.router
            d0.healthy = True
            await until_healthy(app, "d0")
            assert state.cache_view.engine_id("d0") is None, "not polled yet: the window this test is about"
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "p0", resp.text
            d0.healthy = False
            for _ in range(3):
                await app.state.health_checker.check_all()
            state.cache_view.forget_engine_id("d0")  # what the poller does for an unhealthy instance
            d0.engine_id, d0.healthy = "engine-d0-restarted", True
            await until_healthy(app, "d0")
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "p0", resp.text

    asyncio.run(main())
    readers = [body["kv_transfer_params"].get("decode_engine_id") for body in p.bodies]
    assert readers == ["engine-d0", "engine-d0-restarted"]
    assert [body["kv_transfer_params"]["decode_engine_id"] for body in d0.bodies] == readers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_decode_instance_of_ours_whose_engine_id_cannot_be_read_prefills_itself(stream):
    """d0 is one of ours (engine reference) but its /v1/cache names no engine id: P is never asked for a hand-off
    nobody is bound to; d0 gets the plain request and prefills it."""
    p = FakeNode("p0", "prefill", **OURS)
    d0 = FakeNode("d0", "decode", reports_engine_id=False, **OURS)

    async def main():
        async with router_harness([p, d0], specs=SPECS) as (client, app):
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-decode"] == "d0" and resp.headers["x-pdcluster-prefill"] == "none"

    asyncio.run(main())
    assert p.bodies == [], "no unbound hand-off was asked for"
    assert len(d0.bodies) == 1 and "kv_transfer_params" not in d0.bodies[0]


def test_vllm_decode_instances_keep_unbound_handoffs():
    """vLLM has no /v1/cache and checks no reader: its P legs name none, as vLLM's protocol has it."""
    p, d0 = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d0]) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "p0", resp.text

    asyncio.run(main())
    assert "decode_engine_id" not in p.bodies[0]["kv_transfer_params"]
