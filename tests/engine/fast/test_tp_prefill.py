"""The fast SPMD prefill (engine/parallel/fast_prefill.py) on 2 gloo ranks, CPU, Triton interpreter, mini's
structure with index_topk 32 (a 150-token prompt exercises the indexer's selection; 4 MLA heads, 4 indexer
heads, 16 experts), each rank on its shard of the weights (its MLA and KDA heads, experts and output rows):

- fp32 weights and activations, token-sharded and head-sharded: every token's logits within 1e-4 of their range
  of the single-rank FastPrefiller's (what differs: the token-local linears run on a rank's rows, the head-wise
  ones on a rank's heads, the experts' pair outputs on their owner, the KDA core on a rank's heads; measured
  here: equal),
  the ranks' logits and attention rows bitwise equal (the rows are replicated), each rank's KDA recurrent and
  conv state its heads' share of the single rank's; the bytes each rank put into the attention's and KDA's
  exchanges are engine/parallel/fast_prefill.py's formula (`exchange_formula`), the MoE's moved bytes. Mini's indexer has 4 heads, so
  many keys score exactly 0 (every head's ReLU at 0) and tie at the k-th score: each piece of the prompt is
  scored over rows as wide as the prompt's keys, so top-k breaks those ties as in the one-shot prefill (with
  rows as wide as the piece, 12% of the logits moved by up to 1.3% of their range);
- a resumed step (the first 100 tokens token-sharded, the last 50 at start 100) against the single rank's same
  two steps, within the same bound;
- an Engine over `TPModel` with kernels="fast" runs this prefill (test_tp_decode.py);
- GPU (`gpu`): one rank on CUDA, bf16, compiled segments, a 3000-token prompt: the SPMD prefill
  (both modes) gives the last-token logits of the single-rank FastPrefiller (compiled segments too) within 1% of
  their range."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.cache import RowPool
from engine.fast.decoder import FastDecoder
from engine.fast.prefill import FastPrefiller
from engine.fast.prefill_kda import kda_state_views
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.weights import build_model
from engine.parallel.groups import RankPool
from engine.parallel.kda_shard import head_range
from engine.parallel.shard_plan import all_plans
from tests.engine.fast import _tp_ranks

cpu_ranks = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU: an interpreter test")
TINY = dataclasses.replace(get_preset("kimi-k3.1-mini"), name="mini-topk32", index_topk=32)
LENGTH = 150


def _prompt() -> torch.Tensor:
    return torch.randint(0, 256, (LENGTH,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


def _single_rank(split: int = 0) -> dict:
    """The single-rank FastPrefiller's logits of every token and KDA state of layer 0 (`split`: two steps)."""
    model = build_model(TINY)
    layout = plan_layout(TINY)
    pool = RowPool(layout, TINY, 8)
    table = pool.allocate_request(LENGTH)
    prefiller = FastPrefiller(model, layout, torch.float32)
    prompt = _prompt()
    logits = torch.cat([prefiller.prefill(pool.buffer, prompt[lo:hi], table.attn_row_ids, table.kda_row_ids, lo,
                                          all_logits=True)
                        for lo, hi in ((0, split), (split, LENGTH)) if hi > lo])
    recurrent, conv = kda_state_views(pool.buffer, layout, table.kda_row_ids[0], 0, prefiller.conv_dtype)
    return {"logits": logits, "recurrent": recurrent.clone(), "conv": conv.clone()}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return _single_rank()


def exchange_formula(world_size: int, rank: int, mode: str) -> int:
    """engine/parallel/fast_prefill.py's docstring (docs/SHARDING.md): the bytes rank r puts into one step's
    attention and KDA exchanges, fp32 activations (e = 4), every token's logits gathered; n = the rank's tokens."""
    cfg, w, total = TINY, world_size, LENGTH
    n = all_plans([total], w, "zigzag" if mode == "token" else "contiguous")[rank].num_rows
    d, h, hk = cfg.d_model, cfg.num_heads // w, cfg.kda_num_heads // w
    output = 4 * (total - n) * d // w
    mla = 4 * (w - 1) * n * d + 4 * (w - 1) * total * h * cfg.v_head_dim + output
    if mode == "token":
        mla += 4 * (total - n) * h * cfg.latent_dim + 4 * n * (cfg.num_heads - h) * cfg.kv_lora_rank
    kda = 4 * (w - 1) * n * d + 4 * (w - 1) * total * hk * cfg.kda_head_dim + output
    return cfg.num_mla_layers * mla + cfg.num_kda_layers * kda + 4 * (w - 1) * n * cfg.vocab_size


def _check(results: list[dict], want: dict, label: str, mode: str | None = None) -> None:
    """`mode`: one step of that mode, whose exchanged bytes must be the formula's."""
    span = float(want["logits"].max() - want["logits"].min())
    for rank, res in enumerate(results):
        got = res["logits"]
        print(f"{label}: max |logit diff| / range = {float((got - want['logits']).abs().max()) / span:.2e}")
        torch.testing.assert_close(got, want["logits"], rtol=0, atol=1e-4 * span)
        assert torch.equal(got.argmax(-1), want["logits"].argmax(-1))
        lo, hi = head_range(TINY, 2, rank)
        torch.testing.assert_close(res["recurrent"], want["recurrent"][lo:hi], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["conv"], want["conv"][lo:hi], rtol=1e-4, atol=1e-5)
        assert res["moe_exchange_bytes"] > 0
        if mode is not None:
            assert res["exchange_bytes"] == exchange_formula(len(results), rank, mode), f"rank {rank}'s bytes"
    assert torch.equal(results[0]["logits"], results[1]["logits"]), "the ranks must agree bitwise"
    assert torch.equal(results[0]["attention_rows"], results[1]["attention_rows"]), "the rows are replicated"


@pytest.mark.parametrize("mode", ["token", "head"])
@pytest.mark.process
@cpu_ranks
def test_two_rank_fast_prefill_matches_single_rank(pool2, single_rank, mode: str) -> None:
    results = pool2.run(_tp_ranks.fast_prefill, TINY, _prompt(), mode, torch.float32)
    _check(results, single_rank, f"fast {mode}-sharded prefill (2 ranks)", mode)


@pytest.mark.process
@cpu_ranks
def test_two_rank_fast_prefill_resumed_step(pool2) -> None:
    results = pool2.run(_tp_ranks.fast_prefill, TINY, _prompt(), "token", torch.float32, 100)
    _check(results, _single_rank(100), "fast prefill in two steps (2 ranks)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="one CUDA rank: a GPU test")
@pytest.mark.parametrize("mode", ["token", "head"])
def test_one_rank_fast_prefill_on_cuda_matches_fast_prefiller(mode: str) -> None:
    from engine.parallel.fast_prefill import TPFastPrefiller
    from engine.parallel.fast_tp import TPFastDecoder
    from engine.parallel.groups import ParallelContext

    cuda = torch.device("cuda")
    model = build_model(TINY, device=cuda)
    layout = plan_layout(TINY)
    prompt = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(6))
    out = {}
    for name in ("single", "spmd"):
        pool = RowPool(layout, TINY, 16, device=cuda)
        table = pool.allocate_request(prompt.numel())
        if name == "single":
            prefiller = FastPrefiller(model, layout, decoder=FastDecoder(model, layout, compile=True))
            logits = prefiller.prefill(pool.buffer, prompt, table.attn_row_ids, table.kda_row_ids)
        else:
            decoder = TPFastDecoder(model, layout, ParallelContext.single(cuda), compile=True)
            logits = TPFastPrefiller(decoder).prefill(pool.buffer, prompt, table.attn_row_ids, table.kda_row_ids,
                                                      mode=mode).logits
        out[name] = (logits.cpu(), pool.buffer[table.attn_row_ids].cpu())
    want, got = out["single"][0], out["spmd"][0]
    span = float(want.max() - want.min())
    print(f"1-rank SPMD fast prefill ({mode}) vs FastPrefiller, bf16: max |logit diff| / range = "
          f"{float((got - want).abs().max()) / span:.2e}; attention bytes equal: "
          f"{float((out['single'][1] == out['spmd'][1]).float().mean()):.4f}")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * span)
