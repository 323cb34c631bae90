"""The router on a real socket (router/server.py, fake nodes under uvicorn): the SSE relay streams without
buffering, and a client that goes away at any stage makes the router abort both legs (connection closed, and
`POST /abort_requests` on reference nodes)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from router.app import create_app
from router.config import InstanceSpec, PoolSpec, RouterConfig
from router.settings import Settings
from tests.router.fakes import FakeNode
from tests.router.harness import completion
from tests.router.servers import get, router_server, uvicorn_server, wait_until

pytestmark = pytest.mark.process


def start(stack: ExitStack, nodes: list[FakeNode], engine: str = "vllm", **overrides) -> str:
    urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in nodes}
    config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
        InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine=engine) for n in nodes])
    settings = Settings(**{"health_interval_s": 3600.0, "disagg_min_uncached_tokens": 1, **overrides})
    return stack.enter_context(router_server(create_app(settings, config=config)))


def test_first_chunk_reaches_client_before_last_is_produced():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", num_tokens=6, token_delay_s=0.4)
    with ExitStack() as stack:
        router = start(stack, [p, d])
        arrivals = []
        with httpx.stream("POST", f"{router}/v1/completions", json=completion(stream=True), timeout=20) as resp:
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "p0"
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 6 and len(d.produced_at) == 6
        assert arrivals[0] < d.produced_at[-1] - 1.0, "the relay must not buffer the stream"
        num_early = sum(arrived < produced for arrived, produced in zip(arrivals, d.produced_at[1:]))
        assert num_early >= 3, "chunks are forwarded before the node produces the next one"
        metrics = get(f"{router}/metrics").text
        assert 'pdcluster_requests_total{outcome="ok",pool="default"} 1.0' in metrics
        assert 'pdcluster_inter_token_latency_seconds_count{model="fake-model",pool="default"} 5.0' in metrics


@pytest.mark.parametrize("stage", ["prefill", "before_first_token", "mid_stream"])
def test_client_disconnect_aborts_both_legs(stage):
    p = FakeNode("p0", "prefill", engine_label="reference", delay_s=10.0 if stage == "prefill" else 0.0)
    d = FakeNode("d0", "decode", engine_label="reference", num_tokens=50, token_delay_s=0.2,
                 delay_s=10.0 if stage == "before_first_token" else 0.0)
    with ExitStack() as stack:
        router = start(stack, [p, d], engine="reference")
        client = httpx.Client(timeout=20)
        if stage == "mid_stream":
            with client.stream("POST", f"{router}/v1/completions", json=completion(stream=True)) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{router}/v1/completions", json=completion(stream=True), timeout=0.8)
        client.close()
        leg = p if stage == "prefill" else d
        assert wait_until(lambda: len(leg.cancelled) == 1, 5.0), f"{leg.name} never saw the connection close"
        rid = leg.request_ids[0]
        assert wait_until(lambda: rid in leg.aborted, 5.0), "reference nodes get POST /abort_requests"
        if stage == "prefill":
            assert not d.bodies, "no D leg after the client left during the P leg"
        else:
            assert wait_until(lambda: rid in p.aborted, 5.0), "P's leased rows are released too"
            assert rid not in d.finished
        metrics = get(f"{router}/metrics").text
        assert wait_until(lambda: 'outcome="cancelled"' in get(f"{router}/metrics").text, 5.0), metrics


def test_idle_decode_stream_times_out_with_an_error_event():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", num_tokens=3, token_delay_s=2.0)
    with ExitStack() as stack:
        router = start(stack, [p, d], stream_idle_timeout_s=0.5, breaker_failure_threshold=1,
                       breaker_recovery_s=3600.0, admin_token="t")
        resp = httpx.post(f"{router}/v1/completions", json=completion(stream=True), timeout=20)
        assert resp.status_code == 200
        assert '"code": 504' in resp.text and resp.text.rstrip().endswith("data: [DONE]")
        assert wait_until(lambda: len(d.cancelled) == 1, 5.0)
        metrics = get(f"{router}/metrics").text
        assert 'pdcluster_leg_timeouts_total{leg="decode"} 1.0' in metrics
        assert 'outcome="timeout"' in metrics
        pools = httpx.get(f"{router}/v1/pools", headers={"Authorization": "Bearer t"}, timeout=5).json()
        (link,) = pools["pairs"]
        assert link["link_breaker"] == "open", "a stalled decode stream is a failure of the P->D path"
        assert {i["name"]: i["breaker"] for i in pools["instances"]}["d0"] == "open"


def test_first_token_timeout_answers_504():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", delay_s=5.0)
    with ExitStack() as stack:
        router = start(stack, [p, d], first_token_timeout_s=0.5)
        resp = httpx.post(f"{router}/v1/completions", json=completion(stream=True), timeout=20)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == 504
        assert wait_until(lambda: len(d.cancelled) == 1, 5.0)
        assert 'pdcluster_leg_timeouts_total{leg="first_decode"} 1.0' in get(f"{router}/metrics").text
