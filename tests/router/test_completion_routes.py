"""The completion routes through the router's server (router/server.py -> router/service.py), in process: body
limits, error JSON, request ids, and the router-overhead metric."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from router import service
from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness


def run(coro):
    return asyncio.run(coro)


def metric(text: str, name: str, **labels) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_overhead_is_e2e_minus_the_legs():
    p, d = FakeNode("p0", "prefill", delay_s=0.15), FakeNode("d0", "decode", delay_s=0.15)

    async def main():
        async with router_harness([p, d]) as (client, _):
            plain = await client.post("/v1/completions", json=completion())
            streamed = await client.post("/v1/completions", json=completion(stream=True))
            assert plain.status_code == streamed.status_code == 200
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, "pdcluster_router_overhead_seconds_count", pool="default") == 2.0
    overhead = metric(text, "pdcluster_router_overhead_seconds_sum", pool="default")
    e2e = metric(text, "pdcluster_e2e_request_latency_seconds_sum", pool="default", model="fake-model")
    assert e2e >= 2 * 0.3, "both legs of both requests took their delay"
    assert 0.0 < overhead < e2e - 0.5, "the legs' time is not the router's"


def test_body_limits_and_bad_json_answer_openai_errors():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], max_body_bytes=200) as (client, _):
            big = await client.post("/v1/completions", json=completion("x" * 500))
            bad = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            other = await client.post("/v1/chat/completions", json=[1, 2])
            return big, bad, other

    big, bad, other = run(main())
    assert big.status_code == 413 and "limit of 200" in big.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("request body is not valid JSON: ")
    assert other.status_code == 400 and "JSON object" in other.json()["error"]["message"]
    assert not p.bodies and not d.bodies


def test_unexpected_error_answers_500_json(monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "place", broken)
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            return await client.post("/v1/completions", json=completion())

    resp = run(main())
    assert resp.status_code == 500 and resp.json()["error"]["code"] == 500


def test_request_ids_are_the_routers_own_and_distinct():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            return [await client.post("/v1/completions", json=completion(), headers={"X-Request-Id": "mine"})
                    for _ in range(3)]

    ids = [resp.headers["x-request-id"] for resp in run(main())]
    assert len(set(ids)) == 3 and all(i.startswith("pdc-") for i in ids)
    assert p.request_ids == d.request_ids == ids, "both legs carry the router's id, never the client's"
