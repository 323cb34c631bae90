"""Client disconnects at each stage of a request (queued, during prefill, between the legs, mid-stream)
leave every prefill and decode node at its idle counts (running, waiting, leases, rows from /metrics),
and the router counts the requests as cancelled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

pytestmark = pytest.mark.e2e

LONG_PROMPT_BYTES = {"cpu": 8_000, "cuda": 28_000}
"""Long enough that the prefill leg takes well over CANCEL_AFTER_S: 8K tokens on two CPU cores; on a GPU (the
one-GPU topology, cluster/gpu1.yaml) an 8K prefill ends within CANCEL_AFTER_S, 28K does not."""
CANCEL_AFTER_S = {"cpu": 0.5, "cuda": 0.2}
"""When the during-prefill test leaves: well inside the long prompt's prefill leg (28K tokens take ~0.6 s on
an H200)."""


def _body(model: str, index: int, prompt_bytes: int, max_tokens: int = 16, stream: bool = True) -> dict:
    sentence = "the decode pool streams tokens while prefill ranks shard the prompt. "
    prompt = f"request {index}: " + sentence * (prompt_bytes // len(sentence) + 1)
    return {"model": model, "prompt": prompt[:prompt_bytes], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def _long_prompt_bytes(cluster) -> int:
    return LONG_PROMPT_BYTES[cluster.cluster.config.device]


def _cancelled(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_requests_total", outcome="cancelled") or 0.0


async def _post(url: str, body: dict) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass


async def _cancel_when(cluster, bodies: list[dict], condition: Callable[[], bool], timeout_s: float = 120) -> bool:
    """Start `bodies` concurrently, cancel them all (closing the connections) once `condition` holds."""
    tasks = [asyncio.create_task(_post(cluster.router_url, body)) for body in bodies]
    seen = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(t.done() for t in tasks):
        seen = await asyncio.to_thread(condition)
        if seen:
            break
        await asyncio.sleep(0.02)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return seen


def _prefill_load(cluster):
    return cluster.node_load(cluster.nodes_of(role="prefill")[0].name)


def _check_idle_after(cluster, idle, cancelled_before: float, num_requests: int) -> None:
    cluster.wait_back_to(idle, timeout_s=120)
    cluster.wait_until(lambda: _cancelled(cluster) >= cancelled_before + num_requests, 30,
                       f"{num_requests} cancelled request(s) counted by the router")


def test_disconnect_while_queued(cluster):
    idle = cluster.idle_snapshot()
    before = _cancelled(cluster)
    bodies = [_body(cluster.model, i, 2_000) for i in range(24)]
    seen = asyncio.run(_cancel_when(cluster, bodies, lambda: any(
        load.waiting >= 1 for load in cluster.loads().values())))
    assert seen, "no request was ever queued on a node"
    _check_idle_after(cluster, idle, before, 1)


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


def test_disconnect_during_prefill(cluster):
    """Node gauges change only between engine steps, so "during prefill" is: sent CANCEL_AFTER_S ago and
    the router has not yet seen the prefill leg answer."""
    idle = cluster.idle_snapshot()
    before, legs = _cancelled(cluster), _prefill_legs(cluster)
    cancel_after_s = CANCEL_AFTER_S[cluster.cluster.config.device]
    started = time.monotonic()
    seen = asyncio.run(_cancel_when(cluster, [_body(cluster.model, 100, _long_prompt_bytes(cluster))],
                                    lambda: time.monotonic() - started >= cancel_after_s))
    assert seen and _prefill_legs(cluster) == legs, "the prefill leg ended before the client left"
    _check_idle_after(cluster, idle, before, 1)


def _prefill_answers(cluster) -> float:
    """Prefill legs the prefill node has answered (its max_tokens=1 export requests finish as successes)."""
    return cluster.metrics(cluster.nodes_of(role="prefill")[0].name).get("vllm:request_success_total") or 0.0


def test_disconnect_between_legs(cluster):
    """The client leaves once the prefill node answered its leg (or holds a lease for it): the router is then
    in the transfer/decode leg. The router records leg durations only when a request ends, and a short decode
    leg could finish between two polls, so the decode leg here is long (400 tokens); the prompt need not be (the
    long one's prefill ran to its end here, about 20 s of the suite's two cores)."""
    idle = cluster.idle_snapshot()
    before = _cancelled(cluster)
    answered = _prefill_answers(cluster)

    def prefill_leg_done() -> bool:
        return _prefill_load(cluster).leases >= 1 or _prefill_answers(cluster) > answered

    seen = asyncio.run(_cancel_when(cluster, [_body(cluster.model, 200, 2_000, max_tokens=400)], prefill_leg_done,
                                    timeout_s=300))
    assert seen, "the prefill leg never finished"
    _check_idle_after(cluster, idle, before, 1)


def test_disconnect_mid_stream(cluster):
    idle = cluster.idle_snapshot()
    before = _cancelled(cluster)

    async def read_some() -> int:
        body = _body(cluster.model, 300, 400, max_tokens=400)
        chunks = 0
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream("POST", f"{cluster.router_url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 3:
                        break  # leaving the block closes the connection mid-stream
        return chunks

    assert asyncio.run(read_some()) == 3
    _check_idle_after(cluster, idle, before, 1)
