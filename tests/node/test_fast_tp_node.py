"""A TP decode node started with `--tp 2 --kernels fast` (CPU, gloo, Triton interpreter in the node's environment)
serves a request end to end: its ranks prefill with the fast SPMD prefill (engine/parallel/fast_prefill.py) and
decode with the fast TP step (engine/parallel/fast_tp.py), so the first token and its log-prob are those of a
single-rank engine on the fast kernels (within 1e-3; the reference engine's log-prob differs by ~0.5 here), and
the node reports the fast set (`kernels` label of `vllm:cache_config_info`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.node.nodes import start_node, stop_node, wait_healthy

pytest.importorskip("triton", reason="the fast kernels need the triton package")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test on gloo ranks")]
PROMPT_IDS = [256, 72, 105, 33]
MAX_TOKENS = 2


def _single_rank_fast() -> tuple[int, float]:
    """First token and log-prob of a single-rank engine with kernels="fast" (bf16, the Triton kernels under the
    interpreter: a child process, so that TRITON_INTERPRET is set before triton loads)."""
    code = ("from engine.engine import Engine, EngineConfig\n"
            "from engine.sampling import SamplingParams\n"
            "r = Engine(EngineConfig(model='kimi-k3.1-mini', num_rows=8, kernels='fast', prefix_cache=False)).generate("
            f"'r', {PROMPT_IDS!r}, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))\n"
            "print(r.token_ids[0], repr(r.logprobs[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
                         check=True)
    token, logprob = out.stdout.split()[-2:]
    return int(token), float(logprob)


def test_tp_decode_node_serves_with_fast_kernels() -> None:
    node = start_node("decode", ["--model", "kimi-k3.1-mini", "--tp", "2", "--num-rows", "8", "--kernels", "fast",
                                 "--no-prefix-cache"],
                      env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "DECODE_TRANSPORT": "false",
                           "DECODE_PIN_CORES": "false"})
    try:
        token, logprob = _single_rank_fast()
        wait_healthy(node)
        info = next(line for line in httpx.get(f"{node.url}/metrics", timeout=30).text.splitlines()
                    if line.startswith("vllm:cache_config_info{"))
        assert 'kernels="fast"' in info and 'tp_size="2"' in info
        body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) == MAX_TOKENS
        assert choice["token_ids"][0] == token
        assert abs(choice["logprobs"]["token_logprobs"][0] - logprob) <= 1e-3
    finally:
        stop_node(node)
