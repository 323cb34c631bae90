"""W-rank prefill on real gloo ranks: token-sharded, head-sharded and single-rank agree with KimiModel.prefill."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import get_preset
from engine.model.state import LocalSequenceCache
from engine.model.weights import build_model
from engine.parallel.groups import ParallelContext, RankPool
from engine.parallel.kda_shard import unshard_states
from tests.engine.parallel import _ranks

CFG = get_preset("kimi-k3.1-mini")


def prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in lengths]


@pytest.fixture(scope="module")
def oracle():
    """Single-process KimiModel.prefill, one request at a time (the model's own path)."""
    model = build_model(CFG)
    out = {}

    def run(lengths: tuple[int, ...], prefix: tuple[int, ...], seed: int):
        key = (lengths, prefix, seed)
        if key not in out:
            caches, logits = [], []
            for p, n in zip(prompts([a + b for a, b in zip(lengths, prefix)], seed), prefix):
                cache = LocalSequenceCache(CFG, 1024)
                if n:
                    model.prefill(p[:n], cache, 0)
                logits.append(model.prefill(p[n:], cache, n)[0])
                caches.append(cache)
            out[key] = (torch.stack(logits), caches)
        return out[key]

    return run


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


def assert_same_cache(caches_by_rank, oracle_caches, lengths, prefix) -> None:
    for b, total in enumerate(l + n for l, n in zip(lengths, prefix)):
        want = oracle_caches[b]
        for rank_caches in caches_by_rank:
            got = rank_caches[b]
            assert torch.equal(got.latent[:, :total], want.latent[:, :total]), "latent rows differ"
            assert torch.equal(got.index_key[:, :total], want.index_key[:, :total]), "index keys differ"
            assert torch.equal(got.index_scale[:, :total], want.index_scale[:, :total])
        for i in range(CFG.num_kda_layers):
            full = unshard_states(CFG, [rc[b].kda[i] for rc in caches_by_rank])
            assert torch.equal(full.recurrent, want.kda[i].recurrent), f"KDA state {i} differs"
            assert torch.equal(full.conv, want.kda[i].conv)


CASES = {
    "uneven-batch": ((300, 37, 129), (0, 0, 0)),
    "fewer-tokens-than-pieces": ((3, 1), (0, 0)),
    "cached-prefix-append": ((200, 90), (280, 17)),
}


@pytest.mark.process
@pytest.mark.parametrize("case", list(CASES))
def test_token_sharded_two_ranks_bitwise_equal_to_single_rank(pool2, oracle, case: str) -> None:
    new, prefix = CASES[case]
    ps = prompts([a + b for a, b in zip(new, prefix)])
    want_logits, want_caches = oracle(tuple(new), tuple(prefix), 0)
    # every rank holds its shard of the weights (heads, experts, output rows): still bitwise.
    results = pool2.run(_ranks.prefill_case, CFG, ps, list(prefix), "token", 1024)
    for res in results:
        assert torch.equal(res["logits"], want_logits), "logits differ from the single-rank prefill"
    assert_same_cache([r["caches"] for r in results], want_caches, new, prefix)


@pytest.mark.process
@pytest.mark.parametrize("case", list(CASES))
def test_head_sharded_two_ranks_within_fp32_tolerance(pool2, oracle, case: str) -> None:
    # Head sharding runs the sparse-MLA score GEMM on H/W heads (M = 2 instead of 4 rows), which MKL computes
    # with another summation order: logits agree to fp32 tolerance, not bitwise. The first MLA layer's inputs
    # are still bit-identical, so its cached rows are too.
    new, prefix = CASES[case]
    ps = prompts([a + b for a, b in zip(new, prefix)])
    want_logits, want_caches = oracle(tuple(new), tuple(prefix), 0)
    results = pool2.run(_ranks.prefill_case, CFG, ps, list(prefix), "head", 1024)
    for res in results:
        torch.testing.assert_close(res["logits"], want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(res["logits"].argmax(-1), want_logits.argmax(-1)), "first tokens differ"
        for b, total in enumerate(a + n for a, n in zip(new, prefix)):
            got, want = res["caches"][b], want_caches[b]
            assert torch.equal(got.latent[0, :total], want.latent[0, :total])
            assert torch.equal(got.index_key[0, :total], want.index_key[0, :total])
            differing = (got.latent[:, :total] != want.latent[:, :total]).float().mean()
            assert differing < 0.01, f"{differing:.4f} of latent bytes differ"
    for b in range(len(new)):
        for i in range(CFG.num_kda_layers):
            full = unshard_states(CFG, [r["caches"][b].kda[i] for r in results])
            torch.testing.assert_close(full.recurrent, want_caches[b].kda[i].recurrent, rtol=1e-3, atol=1e-4)


@pytest.mark.process
def test_selections_identical_across_modes(pool2) -> None:
    new, prefix = (300, 37), (0, 0)
    ps = prompts(list(new), seed=4)
    single = _ranks.prefill_case(ParallelContext.single(), CFG, ps, [0, 0], "token", 1024)
    by_mode = {m: pool2.run(_ranks.prefill_case, CFG, ps, [0, 0], m, 1024) for m in ("token", "head")}
    for layer, per_request in enumerate(single["stats"].selections):
        for b, want in enumerate(per_request):
            for mode, results in by_mode.items():
                got = torch.full_like(want, -2)
                for res in results:
                    pos = res["stats"].selection_positions[layer][b]
                    got[pos] = res["stats"].selections[layer][b]
                assert torch.equal(got, want), f"{mode}: layer {layer} request {b} selections differ"
    assert (single["stats"].selections[0][0][-1] >= 0).sum() == CFG.index_topk   # sparse rows were exercised


def test_world_size_one_is_the_model_prefill(oracle) -> None:
    new, prefix = (300, 37), (0, 5)
    ps = prompts([a + b for a, b in zip(new, prefix)])
    want_logits, want_caches = oracle(tuple(new), tuple(prefix), 0)
    res = _ranks.prefill_case(ParallelContext.single(), CFG, ps, list(prefix), "token", 1024)
    assert torch.equal(res["logits"], want_logits)
    assert_same_cache([res["caches"]], want_caches, new, prefix)


@pytest.mark.process
@pytest.mark.parametrize("mode", ["token", "head"])
def test_all_logits_two_ranks_bitwise_equal_to_single_rank(pool2, mode: str) -> None:
    """Every new token's logits (prompt log-probs), gathered in order: the single-rank prefill's (bitwise when
    token-sharded)."""
    new, prefix = (150, 41), (0, 60)
    ps = prompts([a + b for a, b in zip(new, prefix)], seed=9)
    model = build_model(CFG)
    want = []
    for p, n in zip(ps, prefix):
        cache = LocalSequenceCache(CFG, 1024)
        if n:
            model.prefill(p[:n], cache, 0)
        want.append(model.prefill(p[n:], cache, n, all_logits=True))
    results = pool2.run(_ranks.prefill_case, CFG, ps, list(prefix), mode, 1024, True)
    for res in results:
        assert res["logits"].shape == (sum(new), CFG.vocab_size)
        if mode == "token":
            assert torch.equal(res["logits"], torch.cat(want)), "all-token logits differ from the single-rank prefill"
        else:  # head sharding is within fp32 tolerance only (see test_head_sharded_two_ranks_within_fp32_tolerance)
            torch.testing.assert_close(res["logits"], torch.cat(want), rtol=1e-4, atol=1e-4)
