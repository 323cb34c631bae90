"""Router logic in process (httpx ASGI transport) against fake vLLM-protocol nodes."""

from __future__ import annotations

import asyncio
import json

from router.config import PoolSpec
from tests.router.fakes import FakeNode
from tests.router.harness import admin_headers, chat, completion, router_harness


def run(coro):
    return asyncio.run(coro)


def pd_nodes(**decode_kw) -> tuple[FakeNode, FakeNode]:
    return FakeNode("p0", "prefill"), FakeNode("d0", "decode", **decode_kw)


def test_pd_legs_follow_vllm_protocol():
    p, d = pd_nodes()

    async def main():
        async with router_harness([p, d]) as (client, _):
            body = completion(stream=True, stream_options={"include_usage": True}, min_tokens=2,
                              max_completion_tokens=4)
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-prefill"] == "p0"
            assert "t3" in resp.text and resp.text.rstrip().endswith("[DONE]")

    run(main())
    (p_body,), (d_body,) = p.bodies, d.bodies
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_engine_id": None, "remote_block_ids": None,
                                            "remote_host": None, "remote_port": None}
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert d_body["max_tokens"] == 4 and d_body["min_tokens"] == 2
    params = d_body["kv_transfer_params"]
    assert params["remote_engine_id"] == "engine-p0" and params["remote_block_ids"] == [[1, 2]]
    assert params["remote_host"] == "p0.test", "localhost must be rewritten to the prefill's host"
    assert p.request_ids[0] == d.request_ids[0] and p.request_ids[0]


def test_client_kv_transfer_params_never_reach_nodes():
    p, d = pd_nodes()
    evil = {"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 1,
            "remote_engine_id": "evil", "remote_request_id": "x", "remote_block_ids": [[0]]}

    async def main():
        async with router_harness([p, d], disagg_min_uncached_tokens=10_000) as (client, _):
            # short prompt: no P leg, the D leg carries no kv params at all
            r1 = await client.post("/v1/completions", json=completion(kv_transfer_params=evil))
            assert r1.status_code == 200 and r1.headers["x-pdcluster-prefill"] == "none"
        async with router_harness([p, d]) as (client, _):
            r2 = await client.post("/v1/chat/completions", json=chat(kv_transfer_params=evil, stream=True))
            assert r2.status_code == 200

    run(main())
    assert "kv_transfer_params" not in d.bodies[0]
    sent = json.dumps(p.bodies + d.bodies)
    assert "evil" not in sent
    assert d.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "engine-p0"


def test_prefill_retried_on_another_compatible_instance():
    bad, good, d = FakeNode("p0", "prefill", fail_status=500), FakeNode("p1", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([bad, good, d]) as (client, app):
            for _ in range(2):
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "p1"
            metrics = (await client.get("/metrics")).text
            assert 'pdcluster_retries_total{leg="prefill"} 1.0' in metrics

    run(main())
    assert len(good.bodies) == 2 and len(bad.bodies) >= 1


def test_prefill_failure_fallback_policies():
    async def main(policy: str):
        p, d = FakeNode("p0", "prefill", fail_status=503), FakeNode("d0", "decode")
        async with router_harness([p, d], prefill_fallback=policy) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            return resp, d

    resp, d = run(main("decode_only"))
    assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "none"
    assert "kv_transfer_params" not in d.bodies[0]
    resp, d = run(main("fail"))
    assert resp.status_code == 502 and resp.json()["error"]["code"] == 502 and not d.bodies


def test_prefill_timeout_counts_and_falls_back():
    p, d = FakeNode("p0", "prefill", delay_s=5.0), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], prefill_timeout_s=0.2) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "none"
            metrics = (await client.get("/metrics")).text
            assert 'pdcluster_leg_timeouts_total{leg="prefill"} 1.0' in metrics

    run(main())


def test_breaker_opens_after_repeated_prefill_failures():
    p, d = FakeNode("p0", "prefill", fail_status=500), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], breaker_failure_threshold=2) as (client, _):
            for _ in range(4):
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            (pair,) = pools["pairs"]
            assert pair["compatible"] and not pair["usable"]
            metrics = (await client.get("/metrics")).text
            assert 'pdcluster_pair_healthy{decode="d0",prefill="p0"} 0.0' in metrics

    run(main())
    assert len(p.bodies) == 2, "an open breaker keeps requests off the failing prefill"


def test_incompatible_pair_is_never_used_and_explained():
    # decode block size 24 is not a multiple of the prefill's 16
    p, d = FakeNode("p0", "prefill", block_size=16), FakeNode("d0", "decode", block_size=24)

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "none"
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            (pair,) = pools["pairs"]
            assert not pair["compatible"] and "not a multiple" in pair["reasons"][0]

    run(main())
    assert not p.bodies


def test_vllm_and_reference_instances_never_pair():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], specs={"p0": {"engine": "reference"}}) as (client, _):
            pools = (await client.get("/v1/pools", headers=admin_headers())).json()
            assert "engines differ" in " ".join(pools["pairs"][0]["reasons"])

    run(main())


def test_sessions_are_sticky_and_move_to_dcp_pool_when_they_grow():
    nodes = [FakeNode("p0", "prefill"), FakeNode("d0", "decode"), FakeNode("d1", "decode"),
             FakeNode("d2", "decode")]
    pools = [PoolSpec(name="short", kind="tp", max_context_tokens=3000),
             PoolSpec(name="long", kind="dcp", max_context_tokens=100_000)]
    specs = {"d0": {"pool": "short"}, "d1": {"pool": "short"}, "d2": {"pool": "long"}}

    async def main():
        async with router_harness(nodes, pools=pools, specs=specs, session_growth_tokens=500) as (client, _):
            seen = []
            for _ in range(3):
                resp = await client.post("/v1/completions", json=completion(), headers={"X-Session-ID": "s1"})
                seen.append(resp.headers["x-pdcluster-decode"])
            assert len(set(seen)) == 1 and seen[0] in ("d0", "d1")
            long_prompt = "word " * 4000  # ~5000 tokens estimated: outgrows the short pool
            resp = await client.post("/v1/completions", json=completion(long_prompt), headers={"X-Session-ID": "s1"})
            assert resp.headers["x-pdcluster-pool"] == "long" and resp.headers["x-pdcluster-decode"] == "d2"
            assert resp.headers["x-pdcluster-migrated"] == "true"
            # the session stays in the long pool on later short turns (no flapping)
            resp = await client.post("/v1/completions", json=completion(user="s1"))
            assert resp.headers["x-pdcluster-pool"] == "long"
            metrics = (await client.get("/metrics")).text
            assert 'pdcluster_active_sessions{pool="long"} 1.0' in metrics

    run(main())


def test_conditional_disaggregation_skips_short_prompts():
    p, d = pd_nodes()

    async def main():
        async with router_harness([p, d], disagg_min_uncached_tokens=50) as (client, _):
            short = await client.post("/v1/completions", json=completion("hi"))
            long = await client.post("/v1/completions", json=completion("many words " * 40))
            assert short.headers["x-pdcluster-prefill"] == "none"
            assert long.headers["x-pdcluster-prefill"] == "p0"

    run(main())


def test_upstream_client_error_is_relayed():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", fail_status=400)

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 400 and resp.json()["error"]["message"] == "injected"
            assert (await client.get("/health")).status_code == 200

    run(main())


def test_decode_server_error_keeps_its_reason_and_is_logged(caplog):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", fail_status=500)

    async def main():
        async with router_harness([p, d]) as (client, _):
            plain = await client.post("/v1/completions", json=completion())
            streamed = await client.post("/v1/completions", json=completion(stream=True))
            return plain, streamed

    with caplog.at_level("WARNING", logger="router"):
        plain, streamed = run(main())
    assert plain.status_code == 500 and plain.json()["error"]["message"] == "injected"  # JSON: relayed as is
    assert streamed.status_code == 502 and streamed.json()["error"]["message"] == "decode instance d0 answered 500: injected"
    logged = [r.getMessage() for r in caplog.records if r.name == "router"]
    assert len(logged) == 2 and all("upstream_error: leg decode, instance d0" in line and "injected" in line
                                    for line in logged), logged


def test_error_event_inside_a_stream_is_an_upstream_error(caplog):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", num_tokens=6, stream_error_after=2)

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion(stream=True))
            return resp, (await client.get("/metrics")).text

    with caplog.at_level("WARNING", logger="router"):
        resp, metrics = run(main())
    assert resp.status_code == 200 and '"rank 1 died"' in resp.text  # relayed as sent
    assert 'pdcluster_requests_total{outcome="upstream_error",pool="default"} 1.0' in metrics
    assert 'pdcluster_requests_total{outcome="ok",pool="default"} 0.0' in metrics
    assert any("rank 1 died" in r.getMessage() for r in caplog.records if r.name == "router")


def test_drain_moves_new_requests_off_an_instance():
    nodes = [FakeNode("p0", "prefill"), FakeNode("d0", "decode"), FakeNode("d1", "decode")]

    async def main():
        async with router_harness(nodes) as (client, _):
            r = await client.post("/admin/instances/d0/drain", headers=admin_headers())
            assert r.status_code == 200 and r.json()["draining"]
            for _ in range(3):
                assert (await client.post("/v1/completions", json=completion())).headers["x-pdcluster-decode"] == "d1"
            await client.post("/admin/instances/d0/undrain", headers=admin_headers())
            r = await client.post("/admin/instances/nope/drain", headers=admin_headers())
            assert r.status_code == 404

    run(main())


def test_models_health_and_metric_names():
    p, d = pd_nodes()

    async def main():
        async with router_harness([p, d]) as (client, app):
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["fake-model"]
            assert (await client.get("/health")).status_code == 200
            await client.post("/v1/chat/completions", json=chat(stream=True))
            await client.post("/v1/chat/completions", json=chat())
            text = (await client.get("/metrics")).text
            for name in ("pdcluster_time_to_first_token_seconds_bucket", "pdcluster_time_per_output_token_seconds",
                         "pdcluster_inter_token_latency_seconds", "pdcluster_e2e_request_latency_seconds",
                         "pdcluster_leg_duration_seconds", "pdcluster_requests_total", "pdcluster_instance_healthy",
                         "pdcluster_pair_compatible", "pdcluster_pair_healthy"):
                assert name in text, name
            assert 'le="2.0"' in text
            # Counters with labels known in advance exist at 0 before their first event.
            assert 'pdcluster_retries_total{leg="prefill"} 0.0' in text
            assert 'pdcluster_leg_timeouts_total{leg="first_decode"} 0.0' in text
            assert 'pdcluster_requests_total{outcome="timeout",pool=' in text
            assert 'pdcluster_requests_total{outcome="ok",pool="default"} 2.0' in text
            assert 'pdcluster_leg_duration_seconds_count{leg="prefill",pool="default"} 2.0' in text
            d.healthy = False
            for _ in range(2):
                await app.state.health_checker.check_all()
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/livez")).status_code == 200
            # the model is still the cluster's: no healthy decode serves it right now, so come back later
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
            assert resp.json()["error"]["param"] == "model" and "retry later" in resp.json()["error"]["message"]
            resp = await client.post("/v1/completions", json={**completion(), "model": "other-model"})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "model_not_found"
            d.healthy = True
            await app.state.health_checker.check_all()
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    run(main())
