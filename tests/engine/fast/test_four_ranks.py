"""The fast steps on 4 gloo ranks, each on its shard of the weights (one MLA head, one KDA head and 4 of the 16
experts of kimi-k3.1-mini per rank, d_model/4 output rows): CPU, Triton interpreter, fp32 copies. The same checks
and bounds as on 2 ranks against the single-rank fast path (test_tp_decode.py, test_tp_prefill.py): the TP decode
within 1e-4 of the logit range, the token- and head-sharded prefill within 1e-4, greedy tokens equal, every rank's
logits bitwise equal, the prefill's exchanged bytes the formula's. Its own pool of 4 ranks: the 2-rank files' pools have 2."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.groups import RankPool
from engine.parallel.kda_shard import head_range
from tests.engine.fast import _tp_ranks
from tests.engine.fast.test_tp_decode import FIRST, MINI, STEPS, _prompts, check_against_single_rank
from tests.engine.fast.test_tp_prefill import TINY, _prompt, _single_rank, exchange_formula

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU: an interpreter test")]


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, backend="gloo", timeout_s=900) as pool:
        yield pool


def test_four_rank_fast_decode_matches_single_rank_fp32(pool4) -> None:
    results = pool4.run(_tp_ranks.greedy_decode, MINI, _prompts(), FIRST, STEPS, torch.float32)
    for res in results:
        assert res["experts"] == [MINI.num_experts // 4] * (MINI.num_layers - MINI.first_dense_layers)
    check_against_single_rank(results, "fast TP (4 ranks)", 1e-4)
    for res in results[2:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["logits"], res["logits"]))


@pytest.mark.parametrize("mode", ["token", "head"])
def test_four_rank_fast_prefill_matches_single_rank(pool4, mode: str) -> None:
    want = _single_rank()
    results = pool4.run(_tp_ranks.fast_prefill, TINY, _prompt(), mode, torch.float32)
    span = float(want["logits"].max() - want["logits"].min())
    for rank, res in enumerate(results):
        got = res["logits"]
        print(f"fast {mode}-sharded prefill (4 ranks): max |logit diff| / range = "
              f"{float((got - want['logits']).abs().max()) / span:.2e}")
        torch.testing.assert_close(got, want["logits"], rtol=0, atol=1e-4 * span)
        assert torch.equal(got, results[0]["logits"]), "the ranks must agree bitwise"
        lo, hi = head_range(TINY, 4, rank)
        torch.testing.assert_close(res["recurrent"], want["recurrent"][lo:hi], rtol=1e-4, atol=1e-5)
        assert res["exchange_bytes"] == exchange_formula(4, rank, mode), f"rank {rank}'s bytes"
