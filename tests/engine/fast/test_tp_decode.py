"""The fast decode inside the TP decode (engine/parallel/fast_tp.py) on 2 gloo ranks, CPU, Triton interpreter,
kimi-k3.1-mini (2 MLA layers, 6 KDA layers, 7 MoE layers of 16 experts, top-k 256 over a 300-token prompt), each
rank built as a node's rank: its shard of the weights (`build_model(cfg, shard=ShardSpec(2, rank))`):

- fp32 weights and activations: every step's logits equal the single-rank FastDecoder's within 1e-4 of their
  range (what differs: the attention kernel and the KDA projections run a rank's heads, the experts' outputs
  selected per (row, slot) and mixed in slot order instead of the single rank's dense mix), greedy tokens equal,
  both ranks bitwise equal, each rank holding 8 of the 16 experts;
- an Engine over `TPModel` with kernels="fast" (what a TP node builds with `--kernels fast`) runs the fast
  token-sharded prefill (engine/parallel/fast_prefill.py; its first token that of a single-rank fast engine, the
  log-prob within 1e-3) and the fast decode."""

from __future__ import annotations

import pytest
import torch

from engine.cache import RowSequenceCache
from engine.engine import Engine, EngineConfig
from engine.fast.decoder import FastDecoder
from engine.fast.model import decode_on_pool
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.weights import build_model
from engine.parallel.groups import ParallelContext, RankPool
from engine.sampling import SamplingParams
from tests.engine.fast import _tp_ranks

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU: an interpreter test")]
MINI = get_preset("kimi-k3.1-mini")
STEPS = 3
FIRST = [65, 66]


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen) for n in (300, 40)]  # over and under top-k (256)


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


def _single_rank_fast(dtype: torch.dtype) -> tuple[list[list[int]], list[torch.Tensor]]:
    model = build_model(MINI)
    layout = plan_layout(MINI)
    pool, tables = _tp_ranks.prefill_rows(ParallelContext.single(), model, layout, _prompts(), STEPS + 1)
    decoder = FastDecoder(model, layout, dtype)
    caches = [RowSequenceCache(pool, t) for t in tables]
    tokens, positions, logits = [list(FIRST)], [p.numel() for p in _prompts()], []
    for _ in range(STEPS):
        out = decode_on_pool(decoder, layout, torch.tensor(tokens[-1]), positions, caches)
        logits.append(out)
        tokens.append(out.argmax(-1).tolist())
        positions = [n + 1 for n in positions]
    return tokens, logits


def check_against_single_rank(results: list[dict], label: str, atol_frac: float) -> None:
    """Every rank's greedy tokens equal the single-rank FastDecoder's, its logits within `atol_frac` of their
    range, and the ranks agree bitwise."""
    want_tokens, want_logits = _single_rank_fast(torch.float32)
    for res in results:
        assert res["tokens"] == want_tokens
        for got, want in zip(res["logits"], want_logits):
            span = float(want.max() - want.min())
            print(f"{label} vs single rank, fp32: max |logit diff| / range = "
                  f"{float((got - want).abs().max()) / span:.2e}")
            torch.testing.assert_close(got, want, rtol=0, atol=atol_frac * span)
    for a, b in zip(results[0]["logits"], results[1]["logits"]):
        assert torch.equal(a, b), "the ranks must agree bitwise"


def check_engine_results(results: list[dict], prompt: list[int], prefill_kernels: str = "reference") -> None:
    """Both ranks ran the fast decode; the first token and its log-prob are those of a single-rank engine whose
    prefill runs `prefill_kernels` (the log-prob within 1e-3 for the fast prefill, bf16 GEMMs over a rank's rows;
    equal for the reference one); the ranks agree."""
    single = Engine(EngineConfig(num_rows=16, kernels=prefill_kernels, prefix_cache=False)).generate(
        "r", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for res in results:
        assert res["kernels"] == "fast" and res["fast"]
        assert res["tokens"][0] == single.token_ids[0]
        if prefill_kernels == "reference":
            assert res["logprobs"][0] == single.logprobs[0]
        else:
            print(f"first-token log-prob, 2 ranks {res['logprobs'][0]:.6f}, single rank {single.logprobs[0]:.6f}")
            assert abs(res["logprobs"][0] - single.logprobs[0]) <= 1e-3
        assert len(res["tokens"]) == 3
    assert results[0]["tokens"] == results[1]["tokens"] and results[0]["logprobs"] == results[1]["logprobs"]


def test_two_rank_fast_decode_matches_single_rank_fp32(pool2) -> None:
    results = pool2.run(_tp_ranks.greedy_decode, MINI, _prompts(), FIRST, STEPS, torch.float32)
    for res in results:
        assert res["experts"] == [MINI.num_experts // 2] * (MINI.num_layers - MINI.first_dense_layers)
    check_against_single_rank(results, "fast TP (2 ranks)", 1e-4)


def test_tp_engine_runs_the_fast_kernels(pool2) -> None:
    prompt = [256] + list(b"fast tp")
    results = pool2.run(_tp_ranks.engine_generate, "kimi-k3.1-mini", prompt, 3)
    assert [r["fast_prefills"] for r in results] == [1, 1]
    check_engine_results(results, prompt, prefill_kernels="fast")
