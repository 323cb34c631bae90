"""A decode node started with `--kernels fast` serves a request end to end on the fast kernel set: single rank,
kimi-k3.1-mini, on the CPU through the Triton interpreter (TRITON_INTERPRET=1 in the node's environment, which its
rank process inherits). The node says which set it runs (the `kernels` label of `vllm:cache_config_info`), and the greedy tokens and
log-probs it serves are the fast engine's own (an `Engine(kernels="fast")` in a child process), not the
reference engine's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.node.nodes import start_node, stop_node, wait_healthy

pytest.importorskip("triton", reason="the fast kernels need the triton package")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test (a CUDA node runs "
                                 "fast by default: tests/gpu)")]
PROMPT_IDS = [256, 72, 105, 33]
MAX_TOKENS = 2


ORACLE = f"""
import json
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
engine = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=8, kernels="fast"))
assert engine.kernels == "fast"
result = engine.generate("r", {PROMPT_IDS}, SamplingParams(max_tokens={MAX_TOKENS}, temperature=0.0, ignore_eos=True))
print(json.dumps([result.token_ids, result.logprobs]))
"""


def _fast_engine(env: dict[str, str]) -> subprocess.Popen:
    """The fast engine's greedy answer, computed in a child process (the interpreter flag must be set before
    triton is first imported, so not in this one)."""
    return subprocess.Popen([sys.executable, "-c", ORACLE], env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)


def test_decode_node_serves_with_fast_kernels() -> None:
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    oracle = _fast_engine(env)
    node = start_node("decode", ["--model", "kimi-k3.1-mini", "--tp", "1", "--num-rows", "8", "--kernels", "fast",
                                 "--no-prefix-cache"],
                      env={**env, "DECODE_TRANSPORT": "false"})
    try:
        wait_healthy(node)
        metrics = httpx.get(f"{node.url}/metrics", timeout=30).text
        assert 'kernels="fast"' in next(line for line in metrics.splitlines()
                                        if line.startswith("vllm:cache_config_info{"))
        body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        out, _ = oracle.communicate(timeout=300)
        assert oracle.returncode == 0
        want_tokens, want_logprobs = json.loads(out.strip().splitlines()[-1])
        assert choice["token_ids"] == want_tokens
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_logprobs, abs=1e-5)
    finally:
        oracle.kill()
        oracle.wait()
        stop_node(node)
