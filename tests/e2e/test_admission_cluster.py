"""Admission control end to end: 64 concurrent requests through the router to a decode node whose row pool
holds a few imports at a time get 200, or 503/429 with Retry-After, never a 502; imports short of rows queued
on the decode node (its queue-depth gauge moved); the P->D pair stays healthy in the router (no breaker
opened); afterwards every node is back to 0 rows used and 0 leases outstanding.

Its own `pdcluster up` cluster (cluster/launcher.py, the real router and node processes) with the node test
backend (tests/node/toy_backend.py: real row pools, real NIXL transfers, CRC tokens), so the 64 requests stress
admission rather than the reference model on two shared cores.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from cluster.config import parse_config
from cluster.launcher import Cluster
from tests.node.nodes import TOY

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]
NUM_REQUESTS = 64
DECODE_ROWS = 12
"""A one-row prompt plus its KDA rows takes 3 rows (toy layout, block 1024): 4 imports fit at a time."""


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    config = parse_config({
        "model": "kimi-k3.1-mini", "engine": "reference", "startup_timeout_s": 900,
        "router": {"port": None, "settings": {"disagg_min_uncached_tokens": 1, "health_interval_s": 0.5}},
        "pools": [
            {"name": "prefill", "role": "prefill", "tp": 1,
             "settings": {"backend": TOY, "num_rows": 512, "max_context": 4096, "lease_seconds": 120}},
            {"name": "tp", "role": "decode", "tp": 1,
             "settings": {"backend": TOY, "num_rows": DECODE_ROWS, "max_context": 4096,
                          "import_queue_depth": NUM_REQUESTS, "import_queue_wait_s": 60}},
        ]})
    cluster = Cluster(config, tmp_path_factory.mktemp("admission-logs")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _sample(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url, timeout=30).text
    pattern = re.escape(name) + (r"\{[^}]*" + labels + r"[^}]*\}" if labels else r"(\{[^}]*\})?") + r" ([0-9.e+-]+)"
    values = [float(m.groups()[-1]) for m in re.finditer(pattern, text)]
    assert values, f"no {name}{{{labels}}} at {url}"
    return sum(values)


class PeakWatcher:
    """Polls a gauge on a thread and keeps its largest value."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name, self.peak = url, name, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _sample(self.url, self.name))
            except (httpx.HTTPError, AssertionError):
                pass
            self._stop.wait(0.05)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.peak


async def _burst(url: str, model: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int) -> httpx.Response:
            return await client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": f"request {i}: admission control under a small row pool", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True})
        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def test_64_concurrent_requests_short_of_rows_never_get_502(small_cluster):
    cluster = small_cluster
    decode = next(n for n in cluster.nodes if n.role == "decode")
    prefill = next(n for n in cluster.nodes if n.role == "prefill")
    decode_metrics = cluster.metrics_urls[decode.name]
    watcher = PeakWatcher(decode_metrics, "pdcluster_node_import_queue_depth")
    responses = asyncio.run(_burst(cluster.router_url, cluster.model_name))
    peak_queue = watcher.stop()

    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 503}, statuses
    for r in responses:
        if r.status_code != 200:
            assert r.headers.get("retry-after"), (r.status_code, r.text)
            assert r.json()["error"]["code"] == r.status_code
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    assert statuses.count(200) > DECODE_ROWS // 3, statuses  # more than one pool's worth was served
    assert peak_queue > 0, "no import ever waited for rows: the pool was not short"

    router_metrics = f"{cluster.router_url}/metrics"
    assert _sample(router_metrics, "pdcluster_pair_healthy", f'prefill="{prefill.name}"') == 1.0  # no open breaker

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        used = _sample(decode_metrics, "pdcluster_node_kv_rows_used") + _sample(
            cluster.metrics_urls[prefill.name], "pdcluster_node_kv_rows_used")
        leases = _sample(cluster.metrics_urls[prefill.name], "pdcluster_node_leases_outstanding")
        if used == 0 and leases == 0:
            break
        time.sleep(0.5)
    assert (used, leases) == (0, 0)
