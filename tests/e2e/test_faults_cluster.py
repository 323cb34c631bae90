"""Faults with real processes: a killed prefill instance and a killed decode rank.

- Prefill killed mid-run: every in-flight request fails over (the decode node prefills locally) and ends with
  the oracle's tokens; the router marks the instance unhealthy, then healthy again after a restart, and new
  requests take the prefill leg again.
- One DCP rank killed mid-stream: the stream moves to the other decode instance (the `tp` one) and ends with the
  uninterrupted oracle's tokens (router/migration.py), the router marks the killed instance unhealthy; after a
  restart the long-session pool serves oracle tokens again.
These tests run last in the e2e session (conftest orders them) and leave every node running.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.topologies import E2E_CONFIG, LONG_POOL, TP_POOL_CAPACITY
from tests.e2e.harness import choice_token_ids

pytestmark = pytest.mark.e2e

SETTINGS = E2E_CONFIG["router"]["settings"]
REQUEST_BOUND_S = SETTINGS["prefill_timeout_s"] + SETTINGS["first_token_timeout_s"] + 30
HEALTH_BOUND_S = 30
RESUMED_TOKENS = 160
CONCURRENT = 2
LONG_BYTES = 5_000
"""The prefill kill's requests: long enough that no P leg ends within the 1 s before the kill (one such prompt alone
takes longer: tests/e2e/test_resume_cluster.py kills mid-prefill the same way), two at once so that more than one
in-flight leg is placed again; each is prefilled twice more (the decode instance, the oracle)."""
"""Long enough that the stream still runs when the rank dies (the client reads behind the node)."""


def _long_prompt(index: int, num_bytes: int) -> str:
    return (f"job {index}: " + "the prefill ranks exchange query shards before sparse attention runs. " * 300)[:num_bytes]


async def _complete(client, model: str, prompt: str, max_tokens: int) -> list[int] | BaseException:
    import openai  # here, not atop the module: the fast tier collects this module and runs none of it

    try:
        result = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return choice_token_ids(result.choices[0])
    except openai.APIError as exc:
        return exc


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


def test_kill_prefill_mid_run_then_restart(cluster):
    prefill = cluster.nodes_of(role="prefill")[0].name

    async def run() -> list:
        client = cluster.async_client(timeout_s=REQUEST_BOUND_S)
        legs = _prefill_legs(cluster)
        tasks = [asyncio.create_task(_complete(client, cluster.model, _long_prompt(i, LONG_BYTES), 8))
                 for i in range(CONCURRENT)]
        # Node gauges move only between engine steps: "mid-run" is 1 s after sending, before any P leg answered.
        await asyncio.sleep(1.0)
        assert _prefill_legs(cluster) == legs, "the prefill legs ended before the kill"
        cluster.kill(prefill)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=REQUEST_BOUND_S)
        await client.close()
        return [results, time.monotonic() - killed_at]

    results, settle_s = asyncio.run(run())
    assert settle_s < REQUEST_BOUND_S
    # never a client error while a compatible instance lives: the decode instance prefills (decode_only)
    for index, result in enumerate(results):
        assert result == list(cluster.oracle(_long_prompt(index, LONG_BYTES), 8).token_ids), (index, result)
    cluster.wait_until(lambda: cluster.router_sees_healthy(prefill) is False, HEALTH_BOUND_S,
                       f"the router to mark {prefill} unhealthy")

    cluster.restart(prefill)
    cluster.wait_until(lambda: cluster.router_sees_healthy(prefill) is True, HEALTH_BOUND_S,
                       f"the router to mark {prefill} healthy again")
    prompt = "After the restart the prefill pool serves again."
    expected = cluster.oracle(prompt, 8)

    def served_with_prefill_leg() -> bool:
        before = _prefill_legs(cluster)
        choice = cluster.client().completions.create(model=cluster.model, prompt=prompt, max_tokens=8,
                                                     temperature=0).choices[0]
        assert choice_token_ids(choice) == list(expected.token_ids)
        return _prefill_legs(cluster) > before

    cluster.wait_until(served_with_prefill_leg, 60, "a request through the restarted prefill instance", poll_s=1.0)


def test_kill_decode_rank_mid_stream_then_restart(cluster):
    long_node = cluster.nodes_of(role="decode", pool=LONG_POOL)[0]
    # The previous fault test restarts the prefill instance: start from a cluster the router sees whole.
    for node in cluster.nodes:
        cluster.wait_until(lambda node=node: cluster.router_sees_healthy(node.name) is True, HEALTH_BOUND_S,
                           f"the router to see {node.name} healthy")
    prompt = _long_prompt(9, TP_POOL_CAPACITY + 200)  # projected context beyond `tp`: placed on LONG_POOL
    expected = cluster.oracle(prompt, RESUMED_TOKENS)
    client = cluster.client(timeout_s=REQUEST_BOUND_S)
    started = time.monotonic()
    token_ids: list[int] = []
    moved_before = cluster.metrics("router").get("pdcluster_migrations_total") or 0.0
    stream = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=RESUMED_TOKENS, temperature=0,
                                       stream=True, extra_headers={"X-Session-ID": "fault-long"},
                                       extra_body={"return_token_ids": True})
    assert stream.response.headers["x-pdcluster-decode"] == long_node.name
    killed = False
    for chunk in stream:
        if chunk.choices:
            token_ids += choice_token_ids(chunk.choices[0]) or []
        if len(token_ids) >= 2 and not killed:
            cluster.kill_rank(long_node.name)
            killed = True
    assert killed, f"the stream ended after {len(token_ids)} tokens, before the kill"
    # the rank's death moved the stream to the `tp` instance: it ends as the uninterrupted oracle's
    assert token_ids == list(expected.token_ids) and time.monotonic() - started < REQUEST_BOUND_S
    assert cluster.metrics("router").value("pdcluster_migrations_total") == moved_before + 1
    cluster.wait_until(lambda: cluster.router_sees_healthy(long_node.name) is False, HEALTH_BOUND_S,
                       f"the router to mark {long_node.name} unhealthy")

    cluster.restart(long_node.name)
    cluster.wait_until(lambda: cluster.router_sees_healthy(long_node.name) is True, HEALTH_BOUND_S,
                       f"the router to mark {long_node.name} healthy again")
    expected = cluster.oracle(prompt, 8)
    ok_before = cluster.metrics("router").get("pdcluster_requests_total", outcome="ok", pool=LONG_POOL) or 0.0
    result = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_headers={"X-Session-ID": "fault-long-after"})
    assert choice_token_ids(result.choices[0]) == list(expected.token_ids)
    assert cluster.metrics("router").get("pdcluster_requests_total", outcome="ok", pool=LONG_POOL) == ok_before + 1
