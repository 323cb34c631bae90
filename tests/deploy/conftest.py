"""Fixtures for the chart tests: `scrape_targets` is the STAND-IN metrics cluster (tests/deploy/metrics_standin.py).

The same Prometheus check runs against the real `pdcluster up` cluster in tests/e2e/test_prometheus_cluster.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.metrics_standin import StandInCluster
from tests.deploy.prom_support import ScrapeTarget


@pytest.fixture(scope="module")
def standin_cluster() -> Iterator[StandInCluster]:
    cluster = StandInCluster(seed=7).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def scrape_targets(standin_cluster: StandInCluster) -> list[ScrapeTarget]:
    """Where Prometheus scrapes: the stand-in's router and node /metrics, with PodMonitor-style labels."""
    return standin_cluster.targets
