"""The fast decode inside the DCP decode (engine/parallel/fast_dcp.py) on 2 gloo ranks, CPU, Triton interpreter,
kimi-k3.1-mini (2 MLA layers, top-k 256; prompts of 300 and 40 tokens), each rank on its shard of the weights
(as a node's rank: its MLA and KDA heads, experts, output rows), tokens owned in runs of 64 (the
sub-block, the finest interleave the row layout takes): the 300-token request's keys sit on both ranks (172 and
128), so its top-k is a merge of both ranks' candidates; the 40-token request's all on rank 0 (rank 1 attends
over nothing and contributes an empty partial):

- fp32 weights and activations: every step's logits within 1% of their range of the single-rank FastDecoder's
  (what differs: the top-k order, the keys split over two ranks, so the MLA kernel's bf16 probabilities are
  rounded against other running maxima, and the partial outputs merged by log-sum-exp; the fast path against the
  reference is held to the same 1%: test_decoder.py), greedy tokens equal, both ranks bitwise equal, the
  compact merge exchanging candidates;
- an Engine over `DCPModel` with kernels="fast" (what a DCP decode node builds with `--kernels fast`) runs the
  fast decode (its prefill stays the reference one: the first token and its log-prob are the reference's)."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import get_preset
from engine.parallel.groups import RankPool
from tests.engine.fast import _tp_ranks
from tests.engine.fast.test_tp_decode import FIRST, STEPS, _prompts, check_against_single_rank, check_engine_results

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU: an interpreter test")]
MINI = get_preset("kimi-k3.1-mini")


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


def test_two_rank_fast_dcp_decode_matches_single_rank_fp32(pool2) -> None:
    results = pool2.run(_tp_ranks.dcp_greedy_decode, MINI, _prompts(), FIRST, STEPS, torch.float32, 64)
    assert [r["owned"] for r in results] == [[172, 40], [128, 0]]
    assert all(r["merge_bytes"] > 0 for r in results)
    check_against_single_rank(results, "fast DCP (2 ranks)", 1e-2)


def test_dcp_engine_runs_the_fast_decode(pool2) -> None:
    prompt = [256] + list(b"fast dcp")
    check_engine_results(pool2.run(_tp_ranks.dcp_engine_generate, "kimi-k3.1-mini", prompt, 3), prompt)
