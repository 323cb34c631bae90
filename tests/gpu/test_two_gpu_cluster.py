"""Two GPUs of one host: `pdcluster up --device cuda --gpus 2` with its default topology (cluster/default.yaml:
router, prefill TP=2, decode pools `tp` TP=1 and `dcp` DCP=2; cluster/plan.py places the ranks on the two GPUs)
and NIXL VRAM -> VRAM between the GPUs.

- the official `openai` client's completions and chat through the router equal `pdcluster generate --device cuda`
  with the kernels the decode nodes report (tests/oracle.py, in this process), on a prompt the `tp` pool takes and
  one longer than its 8K tokens, which the `dcp` pool takes; P TP=2 -> D TP=1 and P TP=2 -> D DCP=2 are both
  taken (the router's prefill legs and each pool's requests counted);
- rows return to their idle counts after the requests;
- a packed READ from a pool on GPU 1 into one on GPU 0 (benchmarks/transfer_cuda.py at `gpus=2`, the nodes'
  NixlTransport) moves the bytes exactly (checked by digest on both sides).

Needs two CUDA devices and NIXL (`gpu`, never required in CI); starts processes (`process`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
import yaml

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.process,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

SHORT_PROMPT = "Disaggregated serving splits prefill and decode across separate pools of machines."
LONG_PROMPT_TOKENS = 9000
"""Past the `tp` pool's max_context_tokens (8,192 in cluster/default.yaml): the router places it on `dcp`."""
MAX_TOKENS = 16
ROUTER_SETTINGS = {"chars_per_token": 1.0, "disagg_min_uncached_tokens": 1, "health_interval_s": 0.5,
                   "prefill_timeout_s": 300.0, "first_token_timeout_s": 300.0}


def _long_prompt() -> str:
    sentence = "the decode pool streams tokens while prefill ranks shard the prompt. "
    return (sentence * (LONG_PROMPT_TOKENS // len(sentence) + 1))[:LONG_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def two_gpu_cluster(tmp_path_factory: pytest.TempPathFactory, repo_root) -> Iterator:
    from cluster.config import DEFAULT_CONFIG_PATH, parse_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data.update(device="cuda", gpus=2, startup_timeout_s=900)  # a cold start compiles the fast kernels
    data["router"] = {"port": None, "settings": ROUTER_SETTINGS}
    for pool in data["pools"]:
        pool["settings"] = {**pool.get("settings", {}), "max_batch": 4}
    config = parse_config(data, "tests/gpu")
    handle = ClusterHandle(Cluster(config, tmp_path_factory.mktemp("two-gpu-logs"), python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


def _kernels(cluster, pool: str) -> str:
    node = next(n for n in cluster.nodes_of(role="decode") if n.pool == pool)
    info = next(line for line in httpx.get(f"{node.url}/metrics", timeout=30).text.splitlines()
                if line.startswith("vllm:cache_config_info{"))
    return "fast" if 'kernels="fast"' in info else "reference"


def _oracle_ids(cluster, prompt_ids: list[int], pool: str) -> list[int]:
    from tests.oracle import generate

    return generate(prompt_ids, MAX_TOKENS, model=cluster.model, device="cuda",
                    kernels=_kernels(cluster, pool))["token_ids"]


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


def _pool_requests(cluster, pool: str) -> float:
    total = 0.0
    for node in cluster.nodes_of(role="decode"):
        if node.pool == pool:
            total += cluster.metrics(node.name).get("vllm:request_success_total") or 0.0
    return total


def test_config_spreads_the_ranks_over_two_gpus(two_gpu_cluster) -> None:
    assert two_gpu_cluster.cluster.config.device == "cuda"
    assert two_gpu_cluster.cluster.config.gpus == 2


@pytest.mark.parametrize("pool", ["tp", "dcp"])
def test_completion_through_each_pairing_equals_the_oracle(two_gpu_cluster, pool: str) -> None:
    from engine.model.tokenizer import load_tokenizer
    from tests.e2e.harness import choice_token_ids

    prompt = SHORT_PROMPT if pool == "tp" else _long_prompt()
    expected = _oracle_ids(two_gpu_cluster, load_tokenizer(two_gpu_cluster.model).encode(prompt), pool)
    legs, served = _prefill_legs(two_gpu_cluster), _pool_requests(two_gpu_cluster, pool)
    result = two_gpu_cluster.client(timeout_s=600).completions.create(
        model=two_gpu_cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert choice_token_ids(result.choices[0]) == expected
    assert _prefill_legs(two_gpu_cluster) == legs + 1, "the request did not take the prefill leg (P TP=2)"
    assert _pool_requests(two_gpu_cluster, pool) == served + 1, f"the {pool} pool did not serve the request"


def test_chat_equals_the_oracle(two_gpu_cluster) -> None:
    from engine.model.tokenizer import ByteTokenizer, ChatMessage
    from tests.e2e.harness import choice_token_ids

    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What does a decode pool do?"}]
    ids = ByteTokenizer().apply_chat_template([ChatMessage(m["role"], m["content"]) for m in messages])
    expected = _oracle_ids(two_gpu_cluster, ids, "tp")
    result = two_gpu_cluster.client(timeout_s=600).chat.completions.create(
        model=two_gpu_cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    got = choice_token_ids(result.choices[0])
    if got is None:  # chat choices carry no token ids: compare the text the oracle's ids decode to
        from engine.model.tokenizer import load_tokenizer

        assert result.choices[0].message.content == load_tokenizer(two_gpu_cluster.model).decode(expected)
    else:
        assert got == expected


def test_rows_back_to_idle(two_gpu_cluster) -> None:
    idle = two_gpu_cluster.idle_snapshot()
    assert all(load.rows_used == 0 for load in idle.values()), idle
    two_gpu_cluster.client(timeout_s=600).completions.create(model=two_gpu_cluster.model, prompt=_long_prompt(),
                                                             max_tokens=4, temperature=0)
    two_gpu_cluster.wait_back_to(idle, timeout_s=120)


def test_packed_read_between_the_gpus_moves_the_bytes(repo_root) -> None:
    """One Pro-shaped scenario through benchmarks/transfer_cuda.py with the writer on GPU 1: `run` READs every
    method once and compares digests on both sides before timing (it raises on any difference)."""
    from benchmarks.transfer import scenarios
    from benchmarks.transfer_cuda import run

    chosen = [s for s in scenarios(2048, pro_blocks=(256,), run_rows=1) if "Pro" in s["name"]][:1]
    assert chosen, "no Pro-shaped scenario"
    result = run(chosen, rounds=1, settings={}, env={}, gpus=2)
    assert result["mem_type"] == "VRAM" and result["gpus"] == 2
    assert result["copy_GBps"] > 0 and result["scenarios"][0]["packed"]["GBps"] > 0
