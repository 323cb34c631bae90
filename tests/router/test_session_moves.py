"""Session growth moves KV decode-to-decode (router/placement.py `move_source`, router/proxy.py): the turn that
outgrows the short pool sends its P leg to the short pool's decode instance holding the session, whose export the
long pool's instance reads; when that instance refuses, the usual prefill takes the leg."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.cache_view import CachePoller
from router.config import PoolSpec
from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness

POOLS = [PoolSpec(name="short", kind="tp", max_context_tokens=3000),
         PoolSpec(name="long", kind="dcp", max_context_tokens=100_000)]
SPECS = {"p0": {"engine": "reference"}, "d0": {"pool": "short", "engine": "reference"},
         "d1": {"pool": "long", "engine": "reference"}}
LONG_PROMPT = "word " * 4000
"""About 5000 tokens estimated: outgrows the short pool."""


def _nodes() -> list[FakeNode]:
    return [FakeNode(name, role, engine_label="reference", tp_size=1, engine_id=f"engine-{name}",
                     blocks_cached=1)
            for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))]


def _growth_moves(metrics: str) -> float:
    line = next(line for line in metrics.splitlines()
                if line.startswith('pdcluster_migrations_total{reason="session_growth"}'))
    return float(line.split()[-1])


@pytest.mark.parametrize("source_fails", [None, "refuses", "fails", "link-open"],
                         ids=["moves-from-holder", "holder-refuses-prefill-leg", "holder-fails-prefill-leg",
                              "open-link-breaker"])
def test_a_grown_session_reads_its_kv_from_the_decode_instance_holding_it(source_fails):
    """The session's first turn lands on d0; the turn that outgrows the short pool reads d0's export on d1, unless
    d0 refuses it (400), fails it (500) or its link to d1 is open: then the prefill node p0 takes the leg."""
    nodes = _nodes()
    p0, d0, d1 = nodes

    async def main():
        async with router_harness(nodes, pools=POOLS, specs=SPECS, session_growth_tokens=500,
                                  cache_poll_interval_s=3600.0) as (client, app):
            state = app.state.router  # the nodes' cache reports: the router notes what d0 keeps of each turn
            await CachePoller(state.registry, state.cache_view, state.client, 1.0, 5.0).poll_all()
            resp = await client.post("/v1/completions", json=completion(), headers={"X-Session-ID": "s1"})
            assert resp.headers["x-pdcluster-decode"] == "d0" and resp.headers["x-pdcluster-prefill"] == "p0"
            num_p0 = len(p0.bodies)
            d0.fail_status = {"refuses": 400, "fails": 500}.get(source_fails)
            if source_fails == "link-open":
                link = state.breakers.link("d0", "d1")
                for _ in range(link.failure_threshold):
                    link.attempt(time.monotonic()).failed(time.monotonic())
                assert not link.allows(time.monotonic())
            resp = await client.post("/v1/completions", json=completion(LONG_PROMPT),
                                     headers={"X-Session-ID": "s1"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-decode"] == "d1" and resp.headers["x-pdcluster-migrated"] == "true"
            export = d0.bodies[-1]
            assert bool(export.get("kv_transfer_params", {}).get("do_remote_decode")) == (source_fails != "link-open")
            decode_params = d1.bodies[-1]["kv_transfer_params"]
            moves = _growth_moves((await client.get("/metrics")).text)
            if source_fails:  # the prefill node took the leg: the long pool's instance reads from it
                assert resp.headers["x-pdcluster-prefill"] == "p0" and len(p0.bodies) == num_p0 + 1
                assert decode_params["remote_engine_id"] == "engine-p0" and moves == 0
            else:
                assert resp.headers["x-pdcluster-prefill"] == "d0" and len(p0.bodies) == num_p0
                assert decode_params["remote_engine_id"] == "engine-d0" and moves == 1

    asyncio.run(main())
