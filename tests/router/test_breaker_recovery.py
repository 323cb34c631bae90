"""Breakers recover through the router (in process, fake nodes): after a decode instance's breaker opened, its
half-open trial ends whatever the trial's way: a streamed trial answered to its end closes the breaker (it
wedged the instance out of rotation for good before), a client that leaves during the trial's stream or during
its P leg frees the trial slot (neutral), and a failed streamed trial opens the breaker again."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness
from tests.router.servers import wait_until
from tests.router.test_relay_server import start

RECOVERY_S = 0.3


def run(coro):
    return asyncio.run(coro)


async def trip(client: httpx.AsyncClient, app, node: FakeNode, num: int = 2) -> None:
    """`num` failed requests on `node` (threshold 2): its breaker opens; then `node` answers again."""
    node.fail_status = 500
    for _ in range(num):
        assert (await client.post("/v1/completions", json=completion())).status_code >= 500
    node.fail_status = None
    breaker = app.state.router.breakers.instance(node.name)
    assert breaker.opened_at is not None and not breaker.is_trial_inflight
    await asyncio.sleep(RECOVERY_S * 1.5)  # half-open from now


async def serves(client: httpx.AsyncClient, num: int = 3, stream: bool = False) -> list[int]:
    return [(await client.post("/v1/completions", json=completion(stream=stream))).status_code for _ in range(num)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_trial_that_succeeds_closes_the_breaker(stream):
    d0 = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d0], breaker_failure_threshold=2, breaker_recovery_s=RECOVERY_S) as (client, app):
            await trip(client, app, d0)
            trial = await client.post("/v1/completions", json=completion(stream=stream))
            assert trial.status_code == 200 and "data: [DONE]" in trial.text if stream else trial.status_code == 200
            breaker = app.state.router.breakers.instance("d0")
            assert breaker.state(asyncio.get_running_loop().time()) == "closed" and not breaker.is_trial_inflight
            assert await serves(client, stream=stream) == [200, 200, 200]

    run(main())


def test_failed_streamed_trial_opens_the_breaker_again():
    d0 = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d0], breaker_failure_threshold=2, breaker_recovery_s=RECOVERY_S) as (client, app):
            await trip(client, app, d0)
            d0.stream_error_after = 1
            trial = await client.post("/v1/completions", json=completion(stream=True))
            assert trial.status_code == 200 and '"error"' in trial.text
            breaker = app.state.router.breakers.instance("d0")
            assert not breaker.is_trial_inflight and breaker.opened_at is not None
            d0.stream_error_after = None
            await asyncio.sleep(RECOVERY_S * 1.5)
            assert await serves(client, stream=True) == [200, 200, 200]

    run(main())


def test_client_leaving_during_the_trials_prefill_frees_the_slot():
    p, d0 = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d0], breaker_failure_threshold=2, breaker_recovery_s=RECOVERY_S,
                                  prefill_fallback="fail") as (client, app):
            await trip(client, app, p)
            breaker = app.state.router.breakers.instance("p0")
            p.delay_s = 30.0
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=completion(stream=True), timeout=0.5)
            p.delay_s = 0.0
            for _ in range(200):  # the router sees the client leave (connection closed) and ends the attempt
                if not breaker.is_trial_inflight:
                    break
                await asyncio.sleep(0.05)
            assert not breaker.is_trial_inflight, "a client that left ends the trial (neutral)"
            assert breaker.opened_at is not None, "neutral: the breaker stays half-open until a trial answers"
            assert await serves(client, stream=True) == [200, 200, 200]
            assert breaker.opened_at is None and len(p.bodies) == 2 + 1 + 3

    run(main())


@pytest.mark.process
def test_client_leaving_during_a_streamed_trial_frees_the_slot():
    """On real sockets (the in-process transport buffers a node's whole stream): the client reads one chunk of the
    trial's stream and leaves."""
    d0 = FakeNode("d0", "decode", num_tokens=200, token_delay_s=0.05)
    with ExitStack() as stack:
        router = start(stack, [d0], breaker_failure_threshold=2, breaker_recovery_s=RECOVERY_S)
        d0.fail_status = 500
        for _ in range(2):
            assert httpx.post(f"{router}/v1/completions", json=completion(), timeout=20).status_code >= 500
        d0.fail_status = None
        time.sleep(RECOVERY_S * 1.5)
        with httpx.Client(timeout=20) as client:
            with client.stream("POST", f"{router}/v1/completions", json=completion(stream=True)) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break
        assert wait_until(lambda: len(d0.cancelled) == 1, 10.0), "the router closed the trial's D leg"
        d0.num_tokens, d0.token_delay_s = 4, 0.0

        def serves() -> bool:
            return httpx.post(f"{router}/v1/completions", json=completion(), timeout=20).status_code == 200
        assert wait_until(serves, 10.0, 0.1), "the cancelled trial freed the slot: the next request is the trial"
        assert [serves() for _ in range(3)] == [True] * 3
