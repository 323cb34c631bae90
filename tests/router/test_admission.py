"""Admission control and shedding in process: the per-pool cap answers 429 with Retry-After, node shedding
(429, 503 with Retry-After) is relayed and never trips a breaker, the in-flight gauges go back to 0."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, PoolFull, is_node_shed, worker_share
from router.metrics import RouterMetrics
from router.settings import Settings
from router.shared import merge_expositions
from tests.router.fakes import FakeNode
from tests.router.harness import admin_headers, chat, completion, router_harness


def run(coro):
    return asyncio.run(coro)


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start!r} in /metrics")


@pytest.mark.parametrize("cap,workers,share", [(0, 4, 0), (10, 1, 10), (10, 3, 4), (2, 4, 1), (1024, 2, 512)],
                         ids=["no-cap", "one-worker", "rounds-up", "never-zero", "even"])
def test_worker_share(cap, workers, share):
    assert worker_share(cap, workers) == share


def test_admission_caps_per_pool_and_releases():
    settings = Settings(max_inflight_per_pool=4, pool_max_inflight={"dcp": 1}, workers=2)
    adm = Admission(settings, RouterMetrics())
    adm.enter("tp")
    adm.enter("tp")
    with pytest.raises(PoolFull):
        adm.enter("tp")  # this worker's share of 4 is 2
    adm.enter("dcp")
    with pytest.raises(PoolFull):
        adm.enter("dcp")  # ceil(1 / 2) = 1
    adm.leave("tp")
    adm.enter("tp")
    assert adm.inflight == {"tp": 2, "dcp": 1}


@pytest.mark.parametrize("status,headers,shed", [
    (429, {}, True), (503, {"retry-after": "2"}, True), (503, {}, False), (500, {"retry-after": "1"}, False),
    (200, {}, False)], ids=["429", "503-retry-after", "503-bare", "500", "200"])
def test_what_counts_as_node_shedding(status, headers, shed):
    assert is_node_shed(status, headers) is shed


def test_inflight_gauges_add_up_over_workers():
    own = ('# HELP pdcluster_pool_inflight_requests x\n# TYPE pdcluster_pool_inflight_requests gauge\n'
           'pdcluster_pool_inflight_requests{pool="tp"} 3.0\n')
    other = own.replace("3.0", "4.0")
    assert 'pdcluster_pool_inflight_requests{pool="tp"} 7.0' in merge_expositions(own, [other])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_cap_sheds_with_429_and_retry_after(stream):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", delay_s=0.5)

    async def main():
        async with router_harness([p, d], max_inflight_per_pool=2, shed_retry_after_s=3) as (client, app):
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(stream=stream))
                                             for _ in range(5)))
            codes = sorted(r.status_code for r in answers)
            assert codes == [200, 200, 429, 429, 429], codes
            for r in answers:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "3"
                    error = r.json()["error"]
                    assert error["type"] == "rate_limit_error" and "pool default" in error["message"]
            metrics = (await client.get("/metrics")).text
            assert metric(metrics, 'pdcluster_requests_total{outcome="shed",pool="default"}') == 3.0
            assert metric(metrics, 'pdcluster_requests_total{outcome="ok",pool="default"}') == 2.0
            assert metric(metrics, 'pdcluster_pool_inflight_requests{pool="default"}') == 0.0
            assert metric(metrics, 'pdcluster_pool_inflight_limit{pool="default"}') == 2.0
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            assert all(i["breaker"] == "closed" for i in pools["instances"])
            assert app.state.router.admission.inflight == {"default": 0}
            # the slots are free again: the next request is admitted
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    run(main())
    assert len(d.bodies) == 3, "shed requests never reach a node"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("status,headers", [(503, {"Retry-After": "7"}), (429, {"Retry-After": "7"})],
                         ids=["503", "429"])
def test_decode_shedding_is_relayed_and_never_trips_breakers(stream, status, headers):
    p = FakeNode("p0", "prefill", engine_label="reference")
    d = FakeNode("d0", "decode", fail_status=status, fail_headers=headers, engine_label="reference")
    reference = {"p0": {"engine": "reference"}, "d0": {"engine": "reference"}}

    async def main():
        async with router_harness([p, d], specs=reference, breaker_failure_threshold=2) as (client, _):
            for _ in range(5):
                resp = await client.post("/v1/completions", json=completion(stream=stream))
                assert resp.status_code == status and resp.headers["retry-after"] == "7", resp.text
                assert resp.json()["error"]["message"] == "injected"
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            assert all(i["breaker"] == "closed" for i in pools["instances"])
            (pair,) = pools["pairs"]
            assert pair["link_breaker"] == "closed" and pair["usable"]
            metrics = (await client.get("/metrics")).text
            assert metric(metrics, 'pdcluster_requests_total{outcome="shed",pool="default"}') == 5.0
            assert metric(metrics, 'pdcluster_requests_total{outcome="upstream_error",pool="default"}') == 0.0

    run(main())
    assert len(d.bodies) == 5, "the decode breaker stayed closed: every request reached the node"
    assert len(p.aborted) == 5, "the prefill's rows are released at once when decode sheds"


def test_decode_503_without_retry_after_is_a_failure():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", fail_status=503)

    async def main():
        async with router_harness([p, d], breaker_failure_threshold=2) as (client, _):
            codes = [(await client.post("/v1/completions", json=completion())).status_code for _ in range(3)]
            assert codes == [503, 503, 503]
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            assert {i["name"]: i["breaker"] for i in pools["instances"]}["d0"] == "open"

    run(main())
    assert len(d.bodies) == 2, "an open decode breaker keeps requests off the instance"


def test_prefill_shedding_falls_back_without_tripping_its_breaker():
    p = FakeNode("p0", "prefill", fail_status=503, fail_headers={"Retry-After": "1"})
    d = FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], breaker_failure_threshold=2) as (client, _):
            for _ in range(4):
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "none"
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            assert {i["name"]: i["breaker"] for i in pools["instances"]}["p0"] == "closed"

    run(main())
    assert len(p.bodies) == 4
