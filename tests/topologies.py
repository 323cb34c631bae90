"""Topologies shared by the whole test run (a pytest plugin, loaded by tests/conftest.py).

Starting processes is what the suite's time goes to, so every topology that tests only read is started once per
run, whichever package its tests live in, and stopped right after the last test that uses it:

    def test_x(cluster): ...         # the `pdcluster up` reference topology (tests.e2e.harness.ClusterHandle)
    def test_y(vllm_cluster): ...    # `pdcluster up --engine vllm`: the run's one vLLM producer/consumer pair
    def test_z(vllm_pd_pair): ...    # that pair's two servers, (prefill, decode), for tests that bring a router
    def test_w(decode_tp2): ...      # a TP=2 reference decode node peered with `cluster`'s prefill node
    def test_v(checkpoint_cluster): ...  # `cluster`'s shape serving a tiny transformers checkpoint (--model DIR)

`cluster`: router, prefill pool (TP=2, token-sharded prefill), decode pools `tp` (TP=1, capacity TP_POOL_CAPACITY
tokens for placement) and `dcp` (DCP=2: long sessions) on kimi-k3.1-mini, reference engine, free ports.
`checkpoint_cluster`: the same shape on the checkpoint `CHECKPOINT_SPEC` names (tests/checkpoints.py: built by
transformers, with the BPE tokenizer of tests/checkpoint_tokenizer.py beside it), every pool loading its files.
Both come from `_shared_cluster(name, model)`, one running topology per model spec. Tests that talk to its nodes directly (P -> D
hand-offs without the router) use `cluster.node(...)` URLs; a hand-off signed by its prefill node is accepted by
its decode nodes as from the router. `PDCLUSTER_E2E_CONFIG=FILE.yaml` runs another topology (same pool names).

Order (`pytest_collection_modifyitems`): the vLLM pair's users first and VLLM_STOP_TEST last among them, then
`cluster`'s users with the fault tests last (they kill and restart nodes), then `checkpoint_cluster`'s (so no two
shared topologies run at once), then every other test in collection order. `make test` runs them on three xdist
workers (tests/worker_groups.py): the vLLM pair's users on one (group VLLM_GROUP, marker `vllm_pair`), the shared
reference topologies' users on another in this order (group TOPOLOGY_GROUP), the other tests/e2e/ modules, which
start clusters of their own, on the third (group OWN_CLUSTERS_GROUP), then the light tests on whichever worker is
free.
A shared topology stops in the teardown of its last test (the session's end otherwise), so no idle cluster sits
beside the tests that follow. Tests that kill, drain or reconfigure nodes beyond what they restore start their own
(tests/node/nodes.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.vllm_fixtures import SERVED_MODEL

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
    # Both vLLM servers share the two cores with the router and the tests: connects and /health probes can stall
    # for seconds, so the router connects within 30 s, waits 10 s per probe and takes an instance out only after
    # five missed probes in a row (as tests/router/test_vllm_e2e.py), not the default two.
    "router": {"port": None, "settings": {"disagg_min_uncached_tokens": 1, "connect_timeout_s": 30.0,
                                          "health_timeout_s": 10.0, "unhealthy_threshold": 5}},
    "pools": [{"name": "prefill", "role": "prefill", "cores": [0]},
              {"name": "tp", "role": "decode", "cores": [1]}],
}
VLLM_STOP_TEST = "test_vllm_cluster_stops_cleanly"
FAULT_MODULE = "test_faults_cluster"
SHARED = ("vllm_cluster", "cluster", "checkpoint_cluster")
"""The shared topologies, in the order their users run."""
CHECKPOINT_SPEC = ("kimi-mix", "save_bpe_tokenizer")
"""`checkpoint_cluster`'s model: a tests/checkpoints.py kind (KDA and MLA layers interleaved, MoE with shared
experts and grouped top-k) and the tests/checkpoint_tokenizer.py function that writes its tokenizer."""

_last_user: dict[str, str] = {}
"""Shared fixture -> node id of the last selected test that uses it."""
_stoppers: dict[str, Callable[[], None]] = {}
"""Shared fixture -> how to stop it, while it runs."""


def _uses(item: pytest.Item, name: str) -> bool:
    """Whether `item` gets this module's shared fixture `name` (a module's own fixture of that name is not it)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    return bool(defs) and defs[-1].func.__module__ == __name__


def _group(item: pytest.Item) -> int:
    if item.name == VLLM_STOP_TEST:
        return 1
    if _uses(item, "vllm_cluster"):
        return 0
    if _uses(item, "cluster"):
        return 3 if Path(str(item.fspath)).stem == FAULT_MODULE else 2
    if _uses(item, "checkpoint_cluster"):
        return 4
    return 5


TOPOLOGY_GROUP = "topologies"
"""The xdist group of the shared topologies' users. Under `pytest -n 2 --dist loadgroup` (`make test`) they run on
one worker, in the order above, so no two shared topologies run at once."""
OWN_CLUSTERS_GROUP = "own_clusters"
"""The xdist group of the other tests of tests/e2e/, which start clusters of their own to kill, drain or saturate
(most of their time waits for restarts, drains and timeouts). Under `make test` it is a worker's first unit,
beside the shared topologies' users and the vLLM pair's; that worker then takes the light tests (helm renders, routers with fake
upstreams, single nodes, rank groups), one module at a time (tests/worker_groups.py) so a module-scoped fixture
starts once."""
VLLM_GROUP = "vllm_pair"
"""The xdist group of the vLLM pair's users: under `make test` a worker's first unit, so the pair runs once."""
VLLM_MARK = "vllm_pair"
"""Marker given to the vLLM pair's users (`-m vllm_pair` selects them)."""


def _xdist_group(item: pytest.Item) -> str | None:
    if _group(item) < 2:
        return VLLM_GROUP
    if _group(item) < 5:
        return TOPOLOGY_GROUP
    return OWN_CLUSTERS_GROUP if "tests/e2e/" in item.nodeid else None


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the xdist_group marks and before -m selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_group)  # stable: collection order within each group
    for item in items:
        if _group(item) < 2:
            item.add_marker(VLLM_MARK)
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        for name in SHARED:
            if _uses(item, name):
                _last_user[name] = item.nodeid


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        for name in SHARED:
            if _last_user.get(name) == item.nodeid and name in _stoppers:
                _stoppers.pop(name)()


def _shared_cluster(name: str, config, log_dir: Path) -> Iterator:
    """Start `config` as the shared topology `name`; yields its ClusterHandle, stopped after its last user."""
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    handle = ClusterHandle(Cluster(config, log_dir, python=sys.executable).start())
    _stoppers[name] = handle.stop
    try:
        yield handle
    finally:
        _stoppers.pop(name, None)
        handle.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """The reference cluster; `PDCLUSTER_E2E_CONFIG=FILE.yaml` runs another topology (same pool names)."""
    from cluster.config import load_config, parse_config

    override = os.environ.get("PDCLUSTER_E2E_CONFIG")
    config = load_config(override) if override else parse_config(E2E_CONFIG, "tests/topologies.py")
    yield from _shared_cluster("cluster", config, tmp_path_factory.mktemp("cluster-logs"))


def checkpoint_model_dir() -> Path:
    """The directory `checkpoint_cluster` serves (built by transformers once per process)."""
    from tests import checkpoint_tokenizer
    from tests.checkpoints import checkpoint_dir

    kind, tokenizer = CHECKPOINT_SPEC
    return checkpoint_dir(kind, tokenizer=getattr(checkpoint_tokenizer, tokenizer))


@pytest.fixture(scope="session")
def checkpoint_cluster(tmp_path_factory: pytest.TempPathFactory):
    """`cluster`'s shape (P TP=2 -> D `tp` TP=1 / `dcp` DCP=2) on `CHECKPOINT_SPEC`'s checkpoint: `pdcluster up
    --model DIR`."""
    from cluster.config import parse_config

    config = parse_config({**E2E_CONFIG, "model": str(checkpoint_model_dir())}, "tests/topologies.py")
    yield from _shared_cluster("checkpoint_cluster", config, tmp_path_factory.mktemp("checkpoint-cluster-logs"))


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """`pdcluster up --engine vllm --model DIR` on the tiny Llama: a kv_producer on core 0, a kv_consumer on core 1,
    their first P -> D hand-off done (the NIXL handshake's start-up race out of the way: tests.vllm_fixtures)."""
    from cluster.cli import build_parser, resolve_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle
    from tests.vllm_fixtures import RunningServer, cached_tiny_llama, require_vllm, warm_up_handshake

    python = require_vllm()
    work = tmp_path_factory.mktemp("vllm-cluster")
    model_dir = cached_tiny_llama(python)
    (work / "cluster.yaml").write_text(yaml.safe_dump(VLLM_CONFIG))
    args = build_parser().parse_args(["--config", str(work / "cluster.yaml"), "--engine", "vllm", "--model",
                                      str(model_dir), "--vllm-python", str(python), "--router-port", "0"])
    handle = ClusterHandle(Cluster(resolve_config(args), work / "logs", python=sys.executable).start())
    _stoppers["vllm_cluster"] = handle.stop
    try:
        prefill, decode = (RunningServer(role, handle.nodes_of(role=role)[0].url) for role in ("prefill", "decode"))
        warm_up_handshake(prefill, decode)
        yield handle
    finally:
        _stoppers.pop("vllm_cluster", None)
        handle.stop()


@pytest.fixture(scope="session")
def vllm_pd_pair(vllm_cluster):
    """(prefill, decode): the two vLLM servers of `vllm_cluster`, for tests that put their own router in front."""
    from tests.vllm_fixtures import RunningServer

    return tuple(RunningServer(f"vllm-{role}", vllm_cluster.nodes_of(role=role)[0].url)
                 for role in ("prefill", "decode"))


@pytest.fixture(scope="module")
def decode_tp2(cluster):
    """A TP=2 reference decode node beside `cluster`: its secret, its prefill node as the one peer."""
    from tests.node.nodes import start_node, stop_node, wait_healthy

    prefill = cluster.nodes_of(role="prefill")[0]
    host_port = prefill.url.removeprefix("http://")
    env = {"DECODE_CLUSTER_SECRET_FILE": str(cluster.cluster.secret_path),
           "DECODE_PREFILL_PEERS": json.dumps([host_port])}
    node = start_node("decode", ["--model", cluster.model, "--tp", "2", "--num-rows", "24", "--max-num-seqs", "4"],
                      env=env, test_secret=False)
    try:
        wait_healthy(node)
        yield node.url
    finally:
        stop_node(node)
