"""A transformers-built checkpoint served by the one-GPU cluster (cluster/gpu1.yaml with the checkpoint as its
model: router, prefill TP=1, decode TP=1, both nodes on GPU 0, P -> D over NIXL VRAM) through the `openai` client,
against transformers on the same GPU.

The checkpoint is tests/checkpoints.py's `kimi-mix` (KDA and MLA layers interleaved, MoE, a dense-first layer)
with the tokenizer trained in tests/checkpoint_tokenizer.py. Nodes run their default kernels: `auto` serves a
checkpoint on the reference kernels (engine/fast/support.py: the fast kernels need the presets' FP8 latent), in
fp32, so the bound is fp32's, not bf16's:
- teacher-forced log-probs (`echo` with `logprobs`) of a 200-token prompt plus 32 greedy tokens are within
  `LOGPROB_BOUND` of transformers' log-softmax at every position;
- the 32 greedy tokens served through the P -> D leg equal transformers' greedy continuation (one full forward per
  token, fp32, eager attention), and the test prints how many agree before asserting.
Needs a CUDA device, NIXL and transformers (`gpu`, never required in CI); starts processes (`process`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is the oracle")

pytestmark = [pytest.mark.gpu, pytest.mark.process,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KIND = "kimi-mix"
PROMPT_TOKENS = 200
GREEDY_TOKENS = 32
LOGPROB_BOUND = 1e-3
"""Largest |served - transformers| log-prob allowed at any position (fp32 on both sides, different kernels)."""
ROUTER_SETTINGS = {"disagg_min_uncached_tokens": 1, "health_interval_s": 0.5, "prefill_timeout_s": 180.0,
                   "first_token_timeout_s": 180.0}


@pytest.fixture(scope="module")
def checkpoint():
    from tests.checkpoint_tokenizer import save_bpe_tokenizer
    from tests.checkpoints import checkpoint_dir

    return checkpoint_dir(KIND, tokenizer=save_bpe_tokenizer)


@pytest.fixture(scope="module")
def oracle(checkpoint) -> dict:
    """transformers on the GPU: the prompt, its greedy continuation and the log-softmax of every position."""
    from tests.checkpoints import hf_model

    model = hf_model(checkpoint).to("cuda")
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 400, (PROMPT_TOKENS,), generator=gen).tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            seq.append(int(model(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
        logprobs = torch.log_softmax(model(torch.tensor([seq], device="cuda")).logits[0].float(), -1).cpu()
    del model
    torch.cuda.empty_cache()
    # log-prob of token t given tokens < t, for t = 1 .. len(seq) - 1
    taken = logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return {"prompt": prompt, "greedy": seq[PROMPT_TOKENS:], "seq": seq, "token_logprobs": taken.tolist()}


@pytest.fixture(scope="module")
def ckpt_cluster(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from cluster.config import GPU1_CONFIG_PATH, parse_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    data = yaml.safe_load(GPU1_CONFIG_PATH.read_text())
    data["model"] = str(checkpoint)
    data["router"] = {"port": None, "settings": ROUTER_SETTINGS}
    handle = ClusterHandle(Cluster(parse_config(data, "tests/gpu"), tmp_path_factory.mktemp("gpu-ckpt-logs"),
                                   python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)


def test_greedy_through_p_to_d_equals_transformers(ckpt_cluster, oracle) -> None:
    before = ckpt_cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0
    out = _client(ckpt_cluster.router_url).completions.create(
        model=ckpt_cluster.model, prompt=oracle["prompt"], max_tokens=GREEDY_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    extra = out.choices[0].model_extra or {}
    served = list(extra.get("token_ids") or [])
    agree = next((i for i, (a, b) in enumerate(zip(served, oracle["greedy"])) if a != b), len(served))
    print(f"greedy tokens equal to transformers on the GPU: {agree} of {GREEDY_TOKENS}")
    after = ckpt_cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0
    assert after == before + 1, "the request did not take the prefill leg"
    assert served == oracle["greedy"]


def test_teacher_forced_logprobs_within_bound(ckpt_cluster, oracle) -> None:
    out = _client(ckpt_cluster.router_url).completions.create(
        model=ckpt_cluster.model, prompt=oracle["seq"], max_tokens=1, temperature=0, echo=True, logprobs=0)
    served = out.choices[0].logprobs.token_logprobs[1:len(oracle["seq"])]
    assert len(served) == len(oracle["token_logprobs"])
    diff = max(abs(a - b) for a, b in zip(served, oracle["token_logprobs"]))
    print(f"max |served - transformers| teacher-forced log-prob over {len(served)} positions: {diff:.3e}")
    assert diff <= LOGPROB_BOUND
