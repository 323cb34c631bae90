"""The e2e `cluster` fixture: the `pdcluster up` topology on free ports, started once per session.

    def test_x(cluster):            # cluster: cluster.harness.ClusterHandle
        client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none")
        cluster.oracle(prompt, max_tokens)   # `pdcluster generate --json`, the numerical oracle
        cluster.metrics("prefill-0")         # parsed /metrics of a node; cluster.metrics_urls has all
        cluster.kill("prefill-0"); cluster.restart("prefill-0")

Topology (E2E_CONFIG): router, prefill pool (TP=2), decode pools `tp` (TP=1, capacity TP_POOL_CAPACITY
tokens for placement) and `dcp` (DCP=2), on kimi-k3.1-mini, reference engine. A missing node CLI fails
the fixture with the node's log tail: e2e tests never skip for a missing part.

Ordering: the vLLM module runs first (its own pair, torn down before the reference cluster starts, so two
clusters never share the two cores) and fault tests run last (they kill and restart nodes).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.harness import ClusterHandle
from cluster.launcher import Cluster

ADMIN_TOKEN = "e2e-admin-token"
TP_POOL_CAPACITY = 1536
"""Tokens the router places on the `tp` pool; longer projected sessions go to the `dcp` pool."""
SESSION_GROWTH_TOKENS = 64

E2E_CONFIG = {
    "model": "kimi-k3.1-mini",
    "engine": "reference",
    "router": {
        "port": None,
        "admin_token": ADMIN_TOKEN,
        "settings": {
            "chars_per_token": 1.0,
            "session_growth_tokens": SESSION_GROWTH_TOKENS,
            "disagg_min_uncached_tokens": 1,
            "health_interval_s": 0.5,
            "health_timeout_s": 2.0,
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "prefill_timeout_s": 60.0,
            "first_token_timeout_s": 60.0,
            "stream_idle_timeout_s": 60.0,
            "breaker_recovery_s": 2.0,
        },
    },
    "startup_timeout_s": 300,
    "pools": [
        {"name": "prefill", "role": "prefill", "tp": 2},
        {"name": "tp", "role": "decode", "tp": 1, "max_context_tokens": TP_POOL_CAPACITY},
        {"name": "dcp", "role": "decode", "dcp": 2},
    ],
}

_ORDER = {"test_vllm_cluster": 0, "test_faults_cluster": 2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM module first, fault tests last, within the slots e2e tests already hold."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).parent == here]
    ordered = sorted((items[i] for i in slots), key=lambda item: _ORDER.get(Path(str(item.fspath)).stem, 1))
    for slot, item in zip(slots, ordered):
        items[slot] = item


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    config = parse_config(E2E_CONFIG, "tests/e2e/conftest.py")
    handle = ClusterHandle(Cluster(config, log_dir, python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()
