"""STAND-IN for a running cluster's /metrics: not the router or the nodes, only their metric contract.

Until the Prometheus test runs against the real `pdcluster up` cluster (tests/e2e/test_prometheus_cluster.py),
this serves every series of docs/METRICS.md from real prometheus_client registries behind real uvicorn
servers on 127.0.0.1 (one per process of the `pdcluster up` topology: router, prefill, decode `tp`,
decode `dcp`), fed with observations by a background thread while Prometheus scrapes. The series are
built from METRICS.md itself, so the dashboards and rules are checked against the contract, not against
names copied into this file. Pool `dcp` gets slow router TTFTs (3-6 s) so the TTFT alert has something
to fire on; instance `dcp-0` reports unhealthy.
Like the real processes, the router stand-in always answers the text format (router/metrics.py), while node
stand-ins serve prometheus_client's `make_asgi_app`, as vLLM does: it negotiates OpenMetrics, where
prometheus_client 0.26 writes `vllm:x` samples as `vllm_x` (the chart's PodMonitor relabels them back).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_asgi_app
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tests.conftest import free_port
from tests.deploy.metrics_contract import MetricSpec, load_contract
from tests.deploy.prom_support import ScrapeTarget

MODEL = "kimi-k3.1-mini"
NODES = (("prefill-0", "prefill", "prefill", 2, 1), ("tp-0", "decode", "tp", 1, 1), ("dcp-0", "decode", "dcp", 1, 2))
DECODE_POOLS = ("tp", "dcp")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class StandInProcess:
    """One fake process: its registry, metric objects and the labels it reports under."""

    name: str
    role: str  # router | prefill | decode
    pool: str
    tp: int = 1
    dcp: int = 1
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    metrics: dict[str, tuple[MetricSpec, object]] = field(default_factory=dict)


def _label_values(spec: MetricSpec, proc: StandInProcess, rng: random.Random) -> dict[str, str]:
    if spec.name == "pdcluster_instance_healthy":
        name, role, pool, _, _ = rng.choice(NODES)
        return {"instance": name, "role": role, "pool": pool}
    values = {}
    for label in spec.labels:
        if label.values:
            values[label.name] = rng.choice(label.values)
        elif label.name in ("model_name", "model"):
            values[label.name] = MODEL
        elif label.name == "pool":
            values[label.name] = proc.pool if proc.role != "router" else rng.choice(DECODE_POOLS)
        elif label.name == "role":
            values[label.name] = proc.role
        elif label.name == "instance":
            values[label.name] = rng.choice([n[0] for n in NODES])
        elif label.name in ("prefill", "decode"):
            values[label.name] = {"prefill": "prefill-0", "decode": rng.choice(["tp-0", "dcp-0"])}[label.name]
        elif label.name == "finished_reason":
            values[label.name] = rng.choice(["stop", "length"])
        elif label.name == "leg":
            values[label.name] = rng.choice(["prefill", "kv_transfer", "first_decode"])
        else:
            values[label.name] = {"block_size": "1024", "cache_dtype": "fp8", "num_gpu_blocks": "512"}.get(label.name, "x")
    return values


def _make_metric(spec: MetricSpec, registry: CollectorRegistry) -> object:
    names = [label.name for label in spec.labels]
    if spec.kind == "histogram":
        buckets = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8) if "bytes" in spec.name else \
            (1, 2, 5, 10, 20, 50, 100) if "descriptors" in spec.name else LATENCY_BUCKETS
        return Histogram(spec.base_name, spec.name, names, buckets=buckets, registry=registry)
    if spec.kind == "counter":
        return Counter(spec.base_name, spec.name, names, registry=registry)
    return Gauge(spec.base_name, spec.name, names, registry=registry)


def _observe(proc: StandInProcess, spec: MetricSpec, metric, rng: random.Random) -> None:
    labels = _label_values(spec, proc, rng)
    child = metric.labels(**labels) if labels else metric
    if spec.kind == "histogram":
        if "bytes" in spec.name:
            value = rng.uniform(1e5, 5e7)
        elif "descriptors" in spec.name:
            value = rng.randint(1, 80)
        elif spec.name == "pdcluster_time_to_first_token_seconds" and labels.get("pool") == "dcp":
            value = rng.uniform(3.0, 6.0)
        else:
            value = rng.lognormvariate(-2.5, 1.0)
        child.observe(value)
    elif spec.kind == "counter":
        child.inc(rng.randint(1, 50))
    elif spec.kind == "info":
        child.set(1)
    elif spec.name == "pdcluster_instance_healthy":
        child.set(0 if labels["instance"] == "dcp-0" else 1)
    elif spec.name.endswith(("_perc", "_fallback")) or spec.name.startswith("pdcluster_pair_"):
        child.set(rng.random() if spec.name.endswith("_perc") else 1)
    else:
        child.set(rng.randint(0, 16))


def _text_format_app(registry: CollectorRegistry):
    """An ASGI app answering every request with the Prometheus text format (no content negotiation)."""

    async def app(scope, receive, send) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
        await send({"type": "http.response.body", "body": generate_latest(registry)})

    return app


class StandInCluster:
    """Start with `start()`, scrape `targets`, stop with `stop()` (servers and feeder thread end)."""

    def __init__(self, seed: int = 0, feed_interval_s: float = 0.2, max_feed_s: float = 300.0) -> None:
        self.rng = random.Random(seed)
        self.feed_interval_s, self.max_feed_s = feed_interval_s, max_feed_s
        self.processes = [StandInProcess("router", "router", "")]
        self.processes += [StandInProcess(n, role, pool, tp, dcp) for n, role, pool, tp, dcp in NODES]
        contract = load_contract()
        for proc in self.processes:
            scopes = ("router",) if proc.role == "router" else ("node", "node_reference")
            for spec in contract:
                if spec.scope in scopes:
                    proc.metrics[spec.name] = (spec, _make_metric(spec, proc.registry))
        self._servers: list[tuple[uvicorn.Server, threading.Thread, int]] = []
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, name="standin-feeder", daemon=True)
        self.targets: list[ScrapeTarget] = []

    def _feed(self) -> None:
        deadline = time.monotonic() + self.max_feed_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            for proc in self.processes:
                for spec, metric in proc.metrics.values():
                    _observe(proc, spec, metric, self.rng)
            self._stop.wait(self.feed_interval_s)

    def start(self) -> "StandInCluster":
        for proc in self.processes:
            port = free_port()
            app = _text_format_app(proc.registry) if proc.role == "router" else make_asgi_app(proc.registry)
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                    lifespan="off")
            server = uvicorn.Server(config)
            thread = threading.Thread(target=server.run, name=f"standin-{proc.name}", daemon=True)
            thread.start()
            self._servers.append((server, thread, port))
            labels = {"job": "pdcluster-router"} if proc.role == "router" else {
                "job": "pdcluster-nodes", "pool": proc.pool, "role": proc.role, "tp": str(proc.tp),
                "dcp": str(proc.dcp), "engine_kind": "reference", "pod": proc.name}
            self.targets.append(ScrapeTarget(f"http://127.0.0.1:{port}/metrics", labels))
        deadline = time.monotonic() + 15
        while not all(server.started for server, _, _ in self._servers):
            assert time.monotonic() < deadline, "stand-in uvicorn servers did not start within 15 s"
            time.sleep(0.05)
        self._feeder.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._feeder.is_alive():
            self._feeder.join(timeout=5)
        for server, thread, _ in self._servers:
            server.should_exit = True
        for server, thread, _ in self._servers:
            thread.join(timeout=10)
