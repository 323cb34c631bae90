"""How the router reports a request it fails (in process, fake nodes): every failed request is logged exactly
once, at WARNING, naming its reason, the leg that failed and that leg's instance (a client's own 4xx is one INFO
line); every 503 the router sends carries Retry-After, its own and a node's relayed alike; request ids are
random, so no client can guess another request's id from its own."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness


def run(coro):
    return asyncio.run(coro)


def records_of(caplog, request_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "router" and request_id in r.getMessage()]


async def send(client, stream: bool = False, timeout: float = 30.0):
    return await client.post("/v1/completions", json=completion(stream=stream), timeout=timeout)


SCENARIOS = {
    # name: (nodes, settings, request kwargs, expected status, leg, instance, words of the reason)
    "decode-500": (lambda: [FakeNode("d0", "decode", fail_status=500)], {}, {}, 500, "decode", "d0", "injected"),
    "decode-500-stream": (lambda: [FakeNode("d0", "decode", fail_status=500)], {}, {"stream": True}, 502,
                          "decode", "d0", "answered 500"),
    "error-event-in-stream": (lambda: [FakeNode("d0", "decode", stream_error_after=1)], {}, {"stream": True}, 200,
                              "decode", "d0", "rank 1 died"),
    "prefill-500": (lambda: [FakeNode("p0", "prefill", fail_status=500), FakeNode("d0", "decode")],
                    {"prefill_fallback": "fail"}, {}, 502, "prefill", "p0", "HTTP 500"),
    "decode-timeout": (lambda: [FakeNode("d0", "decode", delay_s=5.0)], {"decode_timeout_s": 0.3}, {}, 504,
                       "decode", "d0", "timed out"),
    "decode-shed": (lambda: [FakeNode("d0", "decode", fail_status=503, fail_headers={"Retry-After": "2"})], {}, {},
                    503, "decode", "d0", "shed"),
    "no-decode-available": (lambda: [FakeNode("d0", "decode", fail_status=500)], {"breaker_failure_threshold": 1},
                            {}, 503, "placement", "none", "no decode instance available"),
}
TRIP_FIRST = {"no-decode-available"}
"""Scenarios whose measured request follows one failure that opened the decode's breaker."""


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_failed_request_is_logged_once_with_reason_leg_and_instance(name, caplog):
    make_nodes, settings, kwargs, status, leg, instance, reason = SCENARIOS[name]

    async def main():
        nodes = make_nodes()
        async with router_harness(nodes, **settings) as (client, _):
            if name in TRIP_FIRST:
                assert (await send(client)).status_code == 500
                nodes[0].fail_status = None
            resp = await send(client, **kwargs)
            await asyncio.sleep(0.05)  # a whole body's bookkeeping runs once it was handed over
            return resp

    with caplog.at_level("INFO", logger="router"):
        resp = run(main())
    assert resp.status_code == status, resp.text
    request_id = resp.headers["x-request-id"]
    logged = records_of(caplog, request_id)
    assert len(logged) == 1, [r.getMessage() for r in logged]
    line = logged[0].getMessage()
    assert logged[0].levelno == logging.WARNING, line
    assert f"leg {leg}, instance {instance}," in line and reason in line, line


def test_the_admission_caps_429_is_logged_once(caplog):
    d0 = FakeNode("d0", "decode", delay_s=1.0)

    async def main():
        async with router_harness([d0], max_inflight_per_pool=1) as (client, _):
            slow = asyncio.create_task(send(client))
            while not d0.bodies:
                await asyncio.sleep(0.01)
            shed = await send(client)
            assert (await slow).status_code == 200
            return shed

    with caplog.at_level("INFO", logger="router"):
        shed = run(main())
    assert shed.status_code == 429 and shed.headers["retry-after"]
    logged = records_of(caplog, shed.headers["x-request-id"])
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "leg admission" in logged[0].getMessage() and "too many requests" in logged[0].getMessage()


def test_a_client_error_is_one_info_line(caplog):
    async def main():
        async with router_harness([FakeNode("d0", "decode")]) as (client, _):
            return await client.post("/v1/completions", json={"model": "fake-model", "prompt": 7})

    with caplog.at_level("INFO", logger="router"):
        resp = run(main())
    assert resp.status_code == 400
    logged = records_of(caplog, resp.headers["x-request-id"])
    assert len(logged) == 1 and logged[0].levelno == logging.INFO


@pytest.mark.parametrize("case", ["breaker-open", "node-503-without-retry-after", "health", "no-model-yet"])
def test_every_503_carries_retry_after(case):
    d0 = FakeNode("d0", "decode", fail_status=503 if case == "node-503-without-retry-after" else None,
                  healthy=case != "health", models_body={"object": "list", "data": []} if case == "no-model-yet"
                  else None)

    async def main():
        async with router_harness([d0], breaker_failure_threshold=1) as (client, _):
            if case == "breaker-open":
                d0.fail_status = 500
                assert (await send(client)).status_code == 500
                d0.fail_status = None
                return await send(client)
            if case == "health":
                return await client.get("/health")
            if case == "no-model-yet":
                return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return await send(client)

    resp = run(main())
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["message"]


def test_request_ids_are_unguessable():
    d0 = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d0]) as (client, _):
            return [(await send(client)).headers["x-request-id"] for _ in range(16)]

    ids = run(main())
    assert ids == d0.request_ids and len(set(ids)) == len(ids)
    randoms = [i.rsplit("-", 1)[1] for i in ids]
    assert all(len(r) == 32 for r in randoms), ids  # 128 random bits in hex
    for a, b in zip(randoms, randoms[1:]):
        # A counter or a clock shares most of its digits with the next id; two random ids share a prefix of 8 hex
        # digits with probability 16**-8 (the check shared 3 and failed about once in 270 runs).
        common = os.path.commonprefix([a, b])
        assert len(common) < 8, f"{a} and {b} share the prefix {common!r}: guessable"
