"""A TP decode node started with `--tp 2 --kernels fast` (CPU, gloo, Triton interpreter in the node's environment)
serves a request end to end: its ranks decode with the fast TP step (engine/parallel/fast_tp.py) after the
reference token-sharded prefill, so the first token and its log-prob are the reference engine's, and the node
reports the fast set (`kernels` label of `vllm:cache_config_info`)."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from tests.node.nodes import start_node, stop_node, wait_healthy

pytest.importorskip("triton", reason="the fast kernels need the triton package")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test on gloo ranks")]
PROMPT_IDS = [256, 72, 105, 33]
MAX_TOKENS = 2


def test_tp_decode_node_serves_with_fast_kernels() -> None:
    node = start_node("decode", ["--model", "kimi-k3.1-mini", "--tp", "2", "--num-rows", "8", "--kernels", "fast",
                                 "--no-prefix-cache"],
                      env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "DECODE_TRANSPORT": "false",
                           "DECODE_PIN_CORES": "false"})
    try:
        reference = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=8, kernels="reference")).generate(
            "r", PROMPT_IDS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        wait_healthy(node)
        info = next(line for line in httpx.get(f"{node.url}/metrics", timeout=30).text.splitlines()
                    if line.startswith("vllm:cache_config_info{"))
        assert 'kernels="fast"' in info and 'tp_size="2"' in info
        body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) == MAX_TOKENS
        assert choice["token_ids"][0] == reference.token_ids[0]
        assert choice["logprobs"]["token_logprobs"][0] == reference.logprobs[0]
        assert "decode runs the fast kernels" in node.log()
    finally:
        stop_node(node)
