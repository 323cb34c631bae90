"""Health and breakers in process: placement skips a decode whose breaker is open, timeouts and 5xx count as
failures (a stalled stream: test_relay_server.py), a decode connect error is retried once on another compatible decode, and every health-probe
failure (a `[]` or garbage `/v1/models`, a timeout) marks only that node unhealthy."""

from __future__ import annotations

import asyncio

import pytest

from router.cache_view import CachePoller
from router.config import InstanceSpec
from router.health import HealthChecker
from router.placement import RequestShape, place
from router.registry import Registry
from tests.router.fakes import FakeNode
from tests.router.harness import admin_headers, completion, node_url, router_harness
from tests.router.test_placement import POOLS, view


def run(coro):
    return asyncio.run(coro)


def breakers(pools: dict) -> dict[str, str]:
    return {i["name"]: i["breaker"] for i in pools["instances"]}


def test_placement_skips_blocked_decodes():
    instances = [view("d0", pool="tp-small"), view("d1", pool="tp-small", inflight=5)]
    shape = RequestShape(session_id=None, prompt_tokens=10, max_tokens=10, expected_growth_tokens=0)
    assert place(shape, None, POOLS, instances, frozenset(), frozenset(), 32).decode == "d0"
    placed = place(shape, None, POOLS, instances, frozenset(), frozenset(), 32, blocked=frozenset({"d0"}))
    assert placed.decode == "d1"


def test_open_decode_breaker_moves_traffic_to_the_other_decode():
    d0, d1 = FakeNode("d0", "decode", fail_status=500), FakeNode("d1", "decode")

    async def main():
        async with router_harness([d0, d1], breaker_failure_threshold=2) as (client, _):
            served_by = []
            for _ in range(6):
                resp = await client.post("/v1/completions", json=completion())
                served_by.append(resp.headers.get("x-pdcluster-decode"))
            assert served_by[2:] == ["d1"] * 4, served_by
            assert breakers((await client.get("/v1/pools", headers=admin_headers())).json())["d0"] == "open"

    run(main())
    assert len(d0.bodies) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_decode_timeouts_count_as_failures(stream):
    d0 = FakeNode("d0", "decode", delay_s=5.0)
    timeouts = {"decode_timeout_s": 0.2, "first_token_timeout_s": 0.2}

    async def main():
        async with router_harness([d0], breaker_failure_threshold=2, **timeouts) as (client, _):
            for _ in range(2):
                assert (await client.post("/v1/completions", json=completion(stream=stream))).status_code == 504
            assert breakers((await client.get("/v1/pools", headers=admin_headers())).json())["d0"] == "open"
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 503, "no usable decode: its breaker is open"

    run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_decode_connect_error_is_retried_once_on_another_decode(stream):
    p, d0, d1 = FakeNode("p0", "prefill"), FakeNode("d0", "decode"), FakeNode("d1", "decode")

    async def main():
        async with router_harness([p, d0, d1]) as (client, app):
            app.state.transport.refused.add("d0.test:80")
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-decode"] == "d1" and resp.headers["x-pdcluster-prefill"] == "p0"
            metrics = (await client.get("/metrics")).text
            assert 'pdcluster_retries_total{leg="decode"} 1.0' in metrics
            assert app.state.router.breakers.instance("d0").num_failures == 1

    run(main())
    assert len(d1.bodies) == 1 and d1.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    assert p.aborted == [], "the handoff stays valid for the retry (nothing aborted)"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_handoff_bound_to_an_unreachable_decode_is_given_back_and_the_other_prefills(stream):
    """A hand-off names its reader (d0): d1 could not redeem it, so the connect retry gives it back at P (abort)
    and sends d1 the request without one (d1 prefills it); nothing bound to d0 ever reaches d1."""
    ours = {"engine_label": "reference", "tp_size": 1}
    p = FakeNode("p0", "prefill", **ours)
    d0, d1 = (FakeNode(name, "decode", engine_id=f"engine-{name}", **ours) for name in ("d0", "d1"))

    async def main():
        reference = {name: {"engine": "reference"} for name in ("p0", "d0", "d1")}
        async with router_harness([p, d0, d1], specs=reference) as (client, app):
            state = app.state.router
            await CachePoller(state.registry, state.cache_view, state.client, 1.0, 5.0).poll_all()
            app.state.transport.refused.add("d0.test:80")
            resp = await client.post("/v1/completions", json=completion(stream=stream))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-decode"] == "d1" and resp.headers["x-pdcluster-prefill"] == "none"
            for _ in range(100):  # the abort is fire-and-forget
                if p.aborted:
                    break
                await asyncio.sleep(0.02)

    run(main())
    assert p.bodies[0]["kv_transfer_params"]["decode_engine_id"] == "engine-d0"
    assert len(d1.bodies) == 1 and "kv_transfer_params" not in d1.bodies[0]
    assert p.aborted == [p.request_ids[0]], "the bound hand-off's lease is given back"


def test_decode_connect_error_without_another_decode_is_502():
    d0 = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d0]) as (client, app):
            app.state.transport.refused.add("d0.test:80")
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 502 and resp.json()["error"]["message"].startswith("decode instance d0")

    run(main())


def test_connect_retry_only_to_a_decode_compatible_with_the_handoff():
    p = FakeNode("p0", "prefill", block_size=16)
    d0, d1 = FakeNode("d0", "decode", block_size=16), FakeNode("d1", "decode", block_size=24)

    async def main():
        async with router_harness([p, d0, d1]) as (client, app):
            app.state.transport.refused.add("d0.test:80")
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 502, "d1 cannot read p0's KV: no retry there"
            assert "decode instance d0" in resp.json()["error"]["message"]

    run(main())
    assert d1.bodies == []


@pytest.mark.parametrize("models_body", [[], {"object": "list", "data": []}, b"not json{", {"data": "x"}],
                         ids=["bare-list", "empty-list", "garbage", "data-not-a-list"])
def test_bad_models_answer_marks_only_that_node_unhealthy(models_body):
    good, bad = FakeNode("d0", "decode"), FakeNode("d1", "decode", models_body=models_body)

    async def main():
        async with router_harness([good, bad]) as (client, _):  # start-up survives the bad node
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            health = {i["name"]: (i["healthy"], i["last_error"]) for i in pools["instances"]}
            assert health["d0"] == (True, None)
            assert health["d1"][0] is False and "/v1/models" in health["d1"][1], health
            for _ in range(3):
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-pdcluster-decode"] == "d0"

    run(main())
    assert bad.bodies == []


def test_probe_survives_any_exception_per_instance():
    registry = Registry()
    for name in ("a", "b"):
        registry.upsert(InstanceSpec(name=name, role="decode", url=f"http://{name}.test:80"))

    class Client:
        async def get(self, url: str, timeout: float):
            if url.startswith("http://a."):
                raise RuntimeError("a bug in a transport")
            raise asyncio.TimeoutError()

    checker = HealthChecker(registry, Client(), interval_s=1, timeout_s=1, unhealthy_threshold=1,
                            healthy_threshold=1, facts_interval_s=1)
    run(checker.check_all())
    states = {s.spec.name: s for s in registry.states()}
    assert not states["a"].is_healthy and "RuntimeError" in states["a"].last_error
    assert not states["b"].is_healthy and "TimeoutError" in states["b"].last_error


def test_node_urls_are_distinct():
    assert node_url(FakeNode("d0", "decode")) != node_url(FakeNode("d1", "decode"))


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_pair_with_other_weights_is_refused_with_its_reason(engine):
    label = engine if engine == "reference" else None
    kw = {"weights": "seed-31"} if engine == "reference" else {"root": "/models/a"}
    other = {"weights": "seed-7"} if engine == "reference" else {"root": "/models/b"}
    p = FakeNode("p0", "prefill", engine_label=label, **other)
    d = FakeNode("d0", "decode", engine_label=label, **kw)
    specs = {"p0": {"engine": engine}, "d0": {"engine": engine}}

    async def main():
        async with router_harness([p, d], specs=specs) as (client, _):
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            (pair,) = pools["pairs"]
            assert not pair["compatible"]
            assert any("weights or tokenizer differ" in reason for reason in pair["reasons"]), pair["reasons"]
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "none"

    run(main())
    assert p.bodies == [], "a prefill with other weights is never used"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_instance_back_from_unhealthy_has_its_breakers_closed(stream):
    """A node killed mid-load opens its breaker; restarted, it comes back healthy. Half-open, it would take one
    request at a time until that request ended (a stream: minutes), and a stream moving off another failed
    instance could not be placed there."""
    p, d0, d1 = FakeNode("p0", "prefill"), FakeNode("d0", "decode", fail_status=500), FakeNode("d1", "decode")

    async def main():
        async with router_harness([p, d0, d1], breaker_failure_threshold=2, breaker_recovery_s=0.0) as (client, app):
            checker, breakers = app.state.health_checker, app.state.router.breakers
            app.state.router.registry.get("d1").num_inflight = 100  # d0 is preferred while usable
            for _ in range(2):
                await client.post("/v1/completions", json=completion(stream=stream))
            assert breakers.instance("d0").opened_at is not None and breakers.link("p0", "d0").opened_at is not None
            d0.healthy = False  # the node is gone ...
            for _ in range(2):
                await checker.check_all()
            d0.healthy, d0.fail_status = True, None  # ... and back
            await checker.check_all()
            assert breakers.instance("d0").state(0.0) == breakers.link("p0", "d0").state(0.0) == "closed"
            trial = breakers.instance("d0").attempt(1e9)
            assert not trial.is_trial and breakers.instance("d0").allows(1e9)  # no single-trial gate
            trial.neutral()

    run(main())
