"""The one-GPU topology (cluster/gpu1.yaml: router, prefill TP=1, decode TP=1, both nodes on GPU 0) on CUDA:
weights and row pools in VRAM, P -> D over NIXL VRAM -> VRAM between the two node processes. The nodes run their
default kernel set (`auto`: the fast kernels on a single-rank CUDA node, engine/kernels.py), and the oracle is
`pdcluster generate --device cuda --kernels fast` (tests/oracle.py, in this process).

- both nodes say they run the fast kernels (the `kernels` label of `vllm:cache_config_info`);
- a node on CUDA (the decode node serving alone) generates the greedy tokens of the oracle;
- through the router (P -> D over NIXL, VRAM on both sides) the tokens equal the same oracle;
- both pools are registered with NIXL as VRAM (the prefill node's side channel says so);
- rows are freed after each request, and a stream aborted mid-way leaves 0 rows used on every node.
Needs a CUDA device and NIXL (`gpu`, never required in CI); starts processes (`process`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
import yaml

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.process,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "Disaggregated serving splits prefill and decode across separate pools of machines."
MAX_TOKENS = 16
WARM_BATCH = 4
ROUTER_SETTINGS = {"chars_per_token": 1.0, "disagg_min_uncached_tokens": 1, "health_interval_s": 0.5,
                   "prefill_timeout_s": 180.0, "first_token_timeout_s": 180.0}


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory, repo_root) -> Iterator:
    from cluster.config import GPU1_CONFIG_PATH, parse_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    data = yaml.safe_load(GPU1_CONFIG_PATH.read_text())
    data["router"] = {"port": None, "settings": ROUTER_SETTINGS}
    # The fast kernels' warm-up compiles the decode step and captures a graph per batch bucket up to max_batch
    # before a node reports healthy (minutes at the default 64); these tests send one request at a time.
    for pool in data["pools"]:
        pool["settings"] = {**pool.get("settings", {}), "max_batch": WARM_BATCH}
    data["startup_timeout_s"] = 600
    config = parse_config(data, "tests/gpu")
    handle = ClusterHandle(Cluster(config, tmp_path_factory.mktemp("gpu-logs"), python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


def _oracle(model: str, max_tokens: int = MAX_TOKENS) -> dict:
    from tests.oracle import generate_text

    return generate_text(PROMPT, max_tokens, model=model, device="cuda", kernels="fast")


def _completion(url: str, model: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _token_ids(choice: dict) -> list[int]:
    assert "token_ids" in choice, f"no token_ids in {choice}"
    return list(choice["token_ids"])


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


def test_config_is_cuda(gpu_cluster) -> None:
    assert gpu_cluster.cluster.config.device == "cuda"


def test_nodes_run_the_fast_kernels(gpu_cluster) -> None:
    for role in ("prefill", "decode"):
        node = gpu_cluster.nodes_of(role=role)[0]
        metrics = httpx.get(f"{node.url}/metrics", timeout=30).text
        info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
        assert 'kernels="fast"' in info, (role, info)


def test_node_on_cuda_equals_generate(gpu_cluster) -> None:
    """The decode node alone (colocated path) on its GPU == `pdcluster generate --device cuda --kernels fast`."""
    expected = _oracle(gpu_cluster.model)
    assert expected["model"] == gpu_cluster.model
    node = gpu_cluster.nodes_of(role="decode")[0]
    result = _completion(node.url, gpu_cluster.model)
    assert _token_ids(result["choices"][0]) == expected["token_ids"]
    assert result["choices"][0]["text"] == expected["text"]


def test_p_to_d_over_vram_equals_oracle(gpu_cluster) -> None:
    expected = _oracle(gpu_cluster.model)
    before = _prefill_legs(gpu_cluster)
    result = _completion(gpu_cluster.router_url, gpu_cluster.model)
    assert _token_ids(result["choices"][0]) == expected["token_ids"]
    assert _prefill_legs(gpu_cluster) == before + 1, "the request did not take the prefill leg"


def test_pools_are_registered_as_vram(gpu_cluster) -> None:
    from kv_transfer.side_channel import fetch_metadata

    node = gpu_cluster.nodes_of(role="prefill")[0]
    host, port = node.url.removeprefix("http://").rsplit(":", 1)
    endpoints = fetch_metadata(host, int(port), gpu_cluster.control_auth, timeout_s=30).endpoints()
    assert endpoints and all(ep.mem_type == "VRAM" for ep in endpoints.values()), endpoints


def test_rows_freed_after_each_request(gpu_cluster) -> None:
    idle = gpu_cluster.idle_snapshot()
    assert all(load.rows_used == 0 for load in idle.values()), idle
    for max_tokens in (1, 5, 24):
        _completion(gpu_cluster.router_url, gpu_cluster.model, max_tokens)
        gpu_cluster.wait_back_to(idle, timeout_s=60)


def test_abort_mid_stream_leaves_no_rows(gpu_cluster) -> None:
    idle = gpu_cluster.idle_snapshot()
    body = {"model": gpu_cluster.model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    chunks = 0
    with httpx.stream("POST", f"{gpu_cluster.router_url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
            if chunks >= 3:
                break  # leave mid-stream: closing the connection aborts the request
    assert chunks >= 3
    gpu_cluster.wait_back_to(idle, timeout_s=120)
    assert all(load.rows_used == 0 for load in gpu_cluster.loads().values())
