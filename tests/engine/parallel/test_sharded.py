"""Ranks that hold only their shard (engine/model/shards.py) on 2 and 4 gloo ranks: prefill and decode logits equal
the whole model's on one rank (bitwise for the token-sharded prefill and the TP / exact-DCP decode, within fp32 for
the head-sharded prefill), and the bytes each rank puts into the prefill's exchanges are docs/SHARDING.md's formula.

The 2-rank bitwise cases also run in test_prefill.py / test_decode.py; this file adds 4 ranks (each holding one of
the mini model's 4 MLA heads, 4 KDA heads, 4 of 16 experts, 64 of 256 output rows) and the byte count.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.config import get_preset
from engine.model.state import LocalSequenceCache
from engine.model.weights import build_model
from engine.parallel.groups import RankPool
from engine.parallel.shard_plan import all_plans
from tests.engine.parallel import _ranks

CFG = get_preset("kimi-k3.1-mini")
LENGTHS = (300, 37)
STEPS = 6


def prompts(lengths: tuple[int, ...], seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in lengths]


@pytest.fixture(scope="module")
def oracle():
    """The whole model on one rank: each prompt's last-token logits, then STEPS greedy decode steps."""
    model = build_model(CFG)
    ps = prompts(LENGTHS)
    caches = [LocalSequenceCache(CFG, p.numel() + STEPS + 1) for p in ps]
    prefill = torch.stack([model.prefill(p, c, 0)[0] for p, c in zip(ps, caches)])
    tokens = [[int(row.argmax())] for row in prefill]
    positions = [p.numel() for p in ps]
    for _ in range(STEPS):
        logits = model.decode(torch.tensor([t[-1] for t in tokens]), positions, caches)
        for b, tok in enumerate(logits.argmax(-1).tolist()):
            tokens[b].append(tok)
        positions = [p + 1 for p in positions]
    return prefill, tokens, logits


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def pool(request):
    with RankPool(request.param, backend="gloo", timeout_s=900) as rank_pool:
        yield rank_pool


def exchange_formula(world_size: int, rank: int, mode: str) -> int:
    """docs/SHARDING.md: bytes rank r puts into the prefill's all-gathers and all-to-alls (fp32 values, FP8
    cache rows), summed over the layers; n = the rank's new tokens, N = the step's, h = H/W, h_k = H_K/W."""
    cfg, w = CFG, world_size
    plans = all_plans(list(LENGTHS), w, "zigzag" if mode == "token" else "contiguous")
    n, total = plans[rank].num_rows, sum(LENGTHS)
    d, h, hk = cfg.d_model, cfg.num_heads // w, cfg.kda_num_heads // w
    cache_row = cfg.latent_dim * cfg.latent_value_bytes + cfg.index_key_value_bytes + 4
    output = 4 * (total - n) * d // w                                   # each rank's output rows, all-to-all
    mla = (w - 1) * n * (cache_row + 4 * d) + 4 * (w - 1) * total * h * cfg.v_head_dim + output
    if mode == "token":
        mla += 4 * (total - n) * h * cfg.latent_dim                      # all-to-all #1: queries
        mla += 4 * n * (cfg.num_heads - h) * cfg.kv_lora_rank            # all-to-all #2: attention outputs
    kda = (w - 1) * n * 4 * d + 4 * (w - 1) * total * hk * cfg.kda_head_dim + output
    return cfg.num_mla_layers * mla + cfg.num_kda_layers * kda


@pytest.mark.process
def test_each_rank_holds_its_slice_of_the_whole_model(pool) -> None:
    from engine.model.shards import ShardSpec

    whole = dict(build_model(CFG).named_parameters())
    for rank, tensors in enumerate(pool.run(_ranks.shard_tensors, CFG)):
        splits = build_model(CFG, shard=ShardSpec(pool.world_size, rank)).splits
        held = 0
        for name, value in tensors.items():
            want = torch.cat([whole[name][lo:hi] for lo, hi in splits[name].rows])
            assert torch.equal(value, want), f"rank {rank}: {name} is not its rows of the whole tensor"
            held += value.numel()
        assert held < sum(p.numel() for p in whole.values()), "a rank holds the whole model"


@pytest.mark.process
def test_replicated_rows_run_each_expert_pair_once(pool) -> None:
    """Decode rows are on every rank: `forward_replicated` gives `forward`'s (and the whole MoE's) bits and runs
    each (row, slot) pair on its owner once, where the all-to-all `forward` runs it once per rank."""
    whole = build_model(CFG).layers[1].ffn
    x = torch.randn(32, CFG.d_model, generator=torch.Generator().manual_seed(11))
    want = whole(x, 32)
    results = pool.run(_ranks.moe_case, CFG, 32)
    for res in results:
        (a2a, a2a_pairs), (replicated, pairs) = res["forward"], res["forward_replicated"]
        assert torch.equal(a2a, want) and torch.equal(replicated, want)
        assert a2a_pairs == pool.world_size * pairs
    assert sum(r["forward_replicated"][1] for r in results) == 32 * CFG.num_experts_per_tok


@pytest.mark.process
@pytest.mark.parametrize("mode", ["token", "head"])
def test_sharded_prefill_matches_whole_model(pool, oracle, mode: str) -> None:
    want, _, _ = oracle
    results = pool.run(_ranks.prefill_case, CFG, prompts(LENGTHS), [0, 0], mode, 1024)
    for rank, res in enumerate(results):
        if mode == "token":
            assert torch.equal(res["logits"], want), f"rank {rank}: token-sharded logits differ from one rank's"
        else:  # the score GEMM runs on H/W heads: another summation order (docs/SHARDING.md, numerics)
            torch.testing.assert_close(res["logits"], want, rtol=1e-4, atol=1e-4)
            assert torch.equal(res["logits"].argmax(-1), want.argmax(-1))
        assert res["stats"].exchange_bytes == exchange_formula(pool.world_size, rank, mode), \
            f"rank {rank}: exchanged bytes differ from the formula"
    assert all(torch.equal(r["logits"], results[0]["logits"]) for r in results), "ranks must agree bitwise"


@pytest.mark.process
@pytest.mark.parametrize("mode", ["tp", "dcp"])
def test_sharded_decode_matches_whole_model(pool, oracle, mode: str) -> None:
    _, want_tokens, want_logits = oracle
    results = pool.run(_ranks.decode_case, CFG, prompts(LENGTHS), STEPS, mode, 1, "compact", "exact")
    for rank, res in enumerate(results):
        assert res["tokens"] == want_tokens, f"rank {rank}: {mode} greedy tokens differ"
        assert torch.equal(res["last_logits"], want_logits), f"rank {rank}: {mode} logits differ from one rank's"
