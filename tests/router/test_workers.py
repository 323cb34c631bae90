"""Several router workers: metric merging, shared drains, session hashing, the chart's worker count, and a
real `pdcluster router --workers 2` in front of the light fake engines."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.config import InstanceSpec
from router.placement import RequestShape, place
from router.registry import Registry
from router.sessions import SessionTable
from router.shared import WorkerShared, merge_expositions
from tests.conftest import REPO_ROOT, free_port
from tests.router.servers import wait_until
from tests.router.test_placement import ALL_PAIRS, INSTANCES, POOLS


def exposition(num_ok: float, latency: float, healthy: float) -> str:
    reg = CollectorRegistry()
    Counter("pdcluster_requests", "Requests.", ["outcome"], registry=reg).labels("ok").inc(num_ok)
    Histogram("pdcluster_e2e", "E2E.", buckets=(0.1, 1.0), registry=reg).observe(latency)
    Gauge("pdcluster_instance_healthy", "Health.", ["instance"], registry=reg).labels('d"0').set(healthy)
    return generate_latest(reg).decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_merge_sums_counters_and_histograms_and_keeps_own_gauges():
    merged = samples(merge_expositions(exposition(3, 0.05, 1.0), [exposition(4, 0.5, 0.0), exposition(1, 5.0, 0.0)]))
    assert merged[("pdcluster_requests_total", (("outcome", "ok"),))] == 8.0
    assert merged[("pdcluster_e2e_bucket", (("le", "0.1"),))] == 1.0
    assert merged[("pdcluster_e2e_bucket", (("le", "1.0"),))] == 2.0
    assert merged[("pdcluster_e2e_bucket", (("le", "+Inf"),))] == 3.0
    assert merged[("pdcluster_e2e_count", ())] == 3.0
    assert merged[("pdcluster_e2e_sum", ())] == pytest.approx(5.55)
    assert merged[("pdcluster_instance_healthy", (("instance", 'd"0'),))] == 1.0, "gauges: the answering worker's"
    assert not any(name.endswith("_created") for name, _ in merged)


def test_merge_of_one_worker_keeps_its_values():
    own = exposition(2, 0.5, 1.0)
    merged = samples(merge_expositions(own, []))
    assert {k: v for k, v in samples(own).items() if not k[0].endswith("_created")} == merged


class FakeState:
    def __init__(self) -> None:
        self.registry = Registry()
        for name in ("d0", "d1"):
            self.registry.upsert(InstanceSpec(name=name, role="decode", url=f"http://{name}:80"))
        self.sessions = SessionTable(ttl_s=60, max_sessions=10)


def test_drain_markers_round_trip(tmp_path):
    first, second = WorkerShared(str(tmp_path), 0), WorkerShared(str(tmp_path), 1)
    state = FakeState()

    async def main():
        await first.set_draining("ns/pod-d0", True)  # no sibling listening: the marker still holds
        await first.set_draining("d0", True)
        second.apply_drains(state)
        assert [s.is_draining for s in state.registry.states()] == [True, False]
        await first.set_draining("d0", False)
        second.apply_drains(state)

    asyncio.run(main())
    assert not any(s.is_draining for s in state.registry.states())
    assert second.drained() == {"ns/pod-d0"}, "names with slashes survive the round trip"


def test_hashed_sessions_agree_whatever_each_worker_sees_of_the_load():
    shape = RequestShape(session_id="agent-7", prompt_tokens=100, max_tokens=100, expected_growth_tokens=0)
    quiet = place(shape, None, POOLS, INSTANCES, ALL_PAIRS, frozenset(), 32, hash_sessions=True)
    busy = [v if v.name != quiet.decode else type(v)(**{**v.__dict__, "num_inflight": 50}) for v in INSTANCES]
    again = place(shape, None, POOLS, busy, ALL_PAIRS, frozenset(), 32, hash_sessions=True)
    assert again.decode == quiet.decode, "the hash, not this worker's view of the load, picks the instance"
    least_loaded = place(shape, None, POOLS, busy, ALL_PAIRS, frozenset(), 32)
    assert least_loaded.decode != quiet.decode
    picks = {place(RequestShape(f"s{i}", 100, 100, 0), None, POOLS, INSTANCES, ALL_PAIRS, frozenset(), 32,
                   hash_sessions=True).decode for i in range(40)}
    assert picks == {"d-s0", "d-s1"}, "sessions spread over the pool's instances"


@pytest.mark.process
@pytest.mark.parametrize("overrides,expected", [({"resources": {"requests": {"cpu": "250m"}}}, "1"),
                                                ({"resources": {"requests": {"cpu": "1500m"}}}, "2"),
                                                ({"resources": {"requests": {"cpu": "4"}}}, "4"),
                                                ({"workers": 3}, "3")], ids=["250m", "1500m", "4", "explicit"])
def test_chart_sets_router_workers_from_its_cpu_request(tmp_path, overrides, expected):
    from tests.deploy.helm_support import RELEASE, arg_value, render  # noqa: PLC0415

    out = render("values.yaml", overrides={"router": overrides}, tmp_dir=tmp_path)
    router = out.named("Deployment", f"{RELEASE}-pdcluster-router")["spec"]["template"]["spec"]["containers"][0]
    assert arg_value(router["args"], "--workers") == expected


def completion() -> dict:
    return {"model": "fake-model", "prompt": "a fairly long prompt for the prefill leg " * 8, "max_tokens": 4}


@pytest.mark.process
def test_two_workers_share_drains_and_metrics():
    """With the periodic sync out of the way (600 s), what the siblings are told is what makes this hold."""
    ports = [free_port() for _ in range(4)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ROUTER_ADMIN_TOKEN": "t",
           "ROUTER_SHARED_SYNC_INTERVAL_S": "600", "ROUTER_DISAGG_MIN_UNCACHED_TOKENS": "1"}
    fakes = subprocess.Popen([sys.executable, "-m", "tests.router.wire_fake", "--ports", *map(str, ports[1:])],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    router = None
    try:
        assert fakes.stdout.readline().strip() == "ready"
        p, d0, d1 = (f"http://127.0.0.1:{port}" for port in ports[1:])
        router = subprocess.Popen([sys.executable, "-c", "import sys; from router.cli import main; "
                                   "sys.exit(main(sys.argv[1:]))", "--prefill", p, "--decode", d0, d1,
                                   "--engine", "vllm", "--port", str(ports[0]), "--workers", "2",
                                   "--log-level", "warning"], cwd=REPO_ROOT, env=env)
        url = f"http://127.0.0.1:{ports[0]}"

        served = {"ok": 0, "pd_workers": set()}

        def both_workers_pair() -> bool:
            """Each worker pairs prefill and decode once its own health probes pass: until both do, a request may
            be served colocated (or refused), so the test counts every 200 it got on the way."""
            try:
                resp = httpx.post(f"{url}/v1/completions", json=completion(), timeout=5)
            except httpx.HTTPError:
                return False
            if resp.status_code == 200:
                served["ok"] += 1
                if resp.headers.get("x-pdcluster-prefill") == "prefill-0":
                    served["pd_workers"].add(resp.headers["x-request-id"].rsplit("-", 1)[0])
            return len(served["pd_workers"]) == 2

        assert wait_until(both_workers_pair, 120.0, 0.05), "router with two workers did not pair on both workers"
        prefixes = set()
        for _ in range(40):  # a fresh connection per request: the kernel spreads them over both workers
            resp = httpx.post(f"{url}/v1/completions", json=completion(), timeout=10)
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "prefill-0"
            prefixes.add(resp.headers["x-request-id"].rsplit("-", 1)[0])
        assert len(prefixes) == 2, "both workers served requests"

        def num_ok() -> float:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            return samples(text).get(("pdcluster_requests_total", (("outcome", "ok"), ("pool", "default"))), 0.0)

        assert num_ok() == served["ok"] + 40, "/metrics on any worker sums every worker's live counters"
        drained = httpx.post(f"{url}/admin/instances/decode-0/drain", headers={"Authorization": "Bearer t"})
        assert drained.status_code == 200
        decodes = {httpx.post(f"{url}/v1/completions", json=completion(), timeout=10).headers["x-pdcluster-decode"]
                   for _ in range(30)}
        assert decodes == {"decode-1"}, "a drain on one worker holds on every worker"
    finally:
        for proc in (router, fakes):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
