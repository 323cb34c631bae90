"""Each fast op against its naive reference on seeded random inputs (tolerances stated per test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.config import get_preset
from engine.model.indexer import index_scores, naive_index_scores, naive_select_topk, select_topk
from engine.model.kda import (causal_conv, causal_conv_step, kda_chunked, kda_recurrent_step, l2_normalize,
                              naive_recurrent_kda)
from engine.model.mla import naive_mla_absorbed, naive_mla_expanded, sparse_mla
from engine.model.moe import MoE, naive_moe
from engine.model.numerics import (FP8_DTYPE, Rotary, apply_rope, check_row_invariance, fp8_quantize_rowwise,
                                   fp8_to_float, hadamard_matrix, naive_rope, pad_rows)
from engine.model.weights import build_model

CFG = get_preset("kimi-k3.1-mini")


def _fp8_values(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).mul(8).clamp(-448, 448).to(FP8_DTYPE).to(torch.float32)


# ---------------------------------------------------------------- indexer (exact scores, stable top-k)


@pytest.mark.parametrize("num_q,num_keys", [(1, 1), (7, 300), (64, 1000)], ids=["1x1", "7x300", "64x1000"])
def test_index_scores_match_naive(num_q: int, num_keys: int) -> None:
    """Tolerance: fp32 rounding of the signed head sum (rtol 1e-5, atol 1e-6 of the largest score); the FP8 dot
    products themselves are exact."""
    gen = torch.Generator().manual_seed(num_q * 7 + num_keys)
    q = _fp8_values((num_q, CFG.index_num_heads, CFG.index_head_dim), gen)
    keys = _fp8_values((num_keys, CFG.index_head_dim), gen)
    weights, scale = torch.randn(num_q, CFG.index_num_heads, generator=gen), torch.rand(num_keys, generator=gen)
    ref = naive_index_scores(q, weights, keys, scale)
    torch.testing.assert_close(index_scores(q, weights, keys, scale), ref, rtol=1e-5,
                               atol=1e-6 * float(ref.abs().max()))


def test_index_scores_do_not_depend_on_block_or_key_count() -> None:
    """Exactness: a query's scores are bit-identical alone, inside a block, and against a longer key list."""
    gen = torch.Generator().manual_seed(1)
    q = _fp8_values((32, CFG.index_num_heads, CFG.index_head_dim), gen)
    keys = _fp8_values((700, CFG.index_head_dim), gen)
    weights, scale = torch.randn(32, CFG.index_num_heads, generator=gen), torch.rand(700, generator=gen)
    block = index_scores(q, weights, keys, scale)
    for i in (0, 5, 31):
        alone = index_scores(q[i : i + 1], weights[i : i + 1], keys[:500], scale[:500])
        assert torch.equal(alone[0], block[i, :500])


@pytest.mark.parametrize("topk", [4, 16, 256])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_select_topk_matches_stable_sort(topk: int, ties: bool) -> None:
    """Exact equality: ties go to the lower position; queries with pos + 1 <= topk keep every key."""
    gen = torch.Generator().manual_seed(topk)
    num_keys = 600
    scores = torch.randn(40, num_keys, generator=gen)
    if ties:
        scores = scores.mul(2).round()  # many equal values
    positions = torch.randint(0, num_keys, (40,), generator=gen)
    positions[:3] = torch.tensor([0, topk - 1, topk])
    assert torch.equal(select_topk(scores, positions, topk), naive_select_topk(scores, positions, topk))


# ---------------------------------------------------------------- MLA


def _mla_inputs(seed: int, num_q: int, num_keys: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h, nope, rope, lora, v = CFG.num_heads, CFG.qk_nope_dim, CFG.qk_rope_dim, CFG.kv_lora_rank, CFG.v_head_dim
    return dict(
        q_nope=torch.randn(num_q, h, nope, generator=gen), q_rope=torch.randn(num_q, h, rope, generator=gen),
        latent=torch.randn(num_keys, lora + rope, generator=gen), w_uk=torch.randn(h, nope, lora, generator=gen) / 8,
        w_uv=torch.randn(h, v, lora, generator=gen) / 8,
    )


def test_mla_absorbed_equals_expanded() -> None:
    """Naive absorbed (per query/head) == naive expanded (per-head keys/values), float64 inside: atol 1e-5."""
    inp = _mla_inputs(0, 6, 50)
    sel = naive_select_topk(torch.randn(6, 50), torch.tensor([0, 3, 20, 30, 40, 49]), 16)
    scale = (CFG.qk_nope_dim + CFG.qk_rope_dim) ** -0.5
    torch.testing.assert_close(naive_mla_absorbed(**inp, selected=sel, scale=scale),
                               naive_mla_expanded(**inp, selected=sel, scale=scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q,num_keys,topk", [(1, 10, 16), (9, 400, 64), (33, 300, 256)],
                         ids=["short", "sparse", "topk256"])
def test_sparse_mla_matches_naive(num_q: int, num_keys: int, topk: int) -> None:
    """Fast absorbed sparse MLA (gathered fixed-k rows, -inf pads) vs naive expanded: fp32, rtol/atol 1e-4."""
    inp = _mla_inputs(num_q, num_q, num_keys)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, num_keys, (num_q,), generator=gen)
    sel = select_topk(torch.randn(num_q, num_keys, generator=gen), positions, topk)
    scale = (CFG.qk_nope_dim + CFG.qk_rope_dim) ** -0.5
    q_abs = torch.cat([torch.einsum("thn,hnc->thc", inp["q_nope"], inp["w_uk"]), inp["q_rope"]], dim=-1)
    o_lat = sparse_mla(q_abs, inp["latent"], sel, scale, CFG.kv_lora_rank)
    fast = torch.einsum("thc,hvc->thv", o_lat, inp["w_uv"])
    torch.testing.assert_close(fast, naive_mla_expanded(**inp, selected=sel, scale=scale), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- KDA


def _kda_inputs(seed: int, num_tokens: int, gate_scale: float) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    h, d = CFG.kda_num_heads, CFG.kda_head_dim
    q = l2_normalize(torch.randn(num_tokens, h, d, generator=gen)) * d**-0.5
    k = l2_normalize(torch.randn(num_tokens, h, d, generator=gen))
    v = torch.randn(num_tokens, h, d, generator=gen)
    g = CFG.kda_gate_lower_bound * torch.sigmoid(torch.randn(num_tokens, h, d, generator=gen) * 3) * gate_scale
    beta = torch.sigmoid(torch.randn(num_tokens, h, generator=gen))
    state = torch.randn(h, d, d, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("gate_scale", [1.0, 0.01], ids=["lb-5", "mild"])
def test_kda_chunked_matches_naive_recurrent(num_tokens: int, gate_scale: float) -> None:
    """Chunked (C=64, 8-token sub-chunks) vs token-by-token float64 reference: atol 2e-5 on outputs and state."""
    q, k, v, g, beta, state = _kda_inputs(num_tokens, num_tokens, gate_scale)
    o, s = kda_chunked(q, k, v, g, beta, state)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=2e-5)


def test_kda_chunked_equals_recurrent_steps() -> None:
    """Prefill (chunked) vs decode (batched recurrent step, one token at a time): atol 2e-5."""
    q, k, v, g, beta, state = _kda_inputs(5, 150, 1.0)
    o_chunk, s_chunk = kda_chunked(q, k, v, g, beta, state)
    s, outs = state.unsqueeze(0), []
    for t in range(q.shape[0]):
        o, s = kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), o_chunk, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(s[0], s_chunk, rtol=1e-4, atol=2e-5)


def test_conv_prefill_equals_conv_steps_bitwise() -> None:
    gen = torch.Generator().manual_seed(2)
    channels = 3 * CFG.kda_num_heads * CFG.kda_head_dim
    x, weight = torch.randn(20, channels, generator=gen), torch.randn(channels, CFG.kda_conv_size, generator=gen)
    state0 = torch.randn(CFG.kda_conv_size - 1, channels, generator=gen)
    y_all, s_all = causal_conv(x, state0, weight)
    y_head, s_head = causal_conv(x[:12], state0, weight)
    s, steps = s_head.unsqueeze(0), []
    for t in range(12, 20):
        y, s = causal_conv_step(x[t : t + 1], s, weight)
        steps.append(y)
    assert torch.equal(torch.cat([y_head] + steps), y_all) and torch.equal(s[0], s_all)


# ---------------------------------------------------------------- MoE, numerics


CHECKPOINT_MOE = {"latent-grouped": dict(num_expert_groups=4, topk_groups=2),
                  "plain-grouped": dict(moe_latent_dim=0, num_expert_groups=4, topk_groups=2),
                  "plain-unnormalised": dict(moe_latent_dim=0, moe_renormalize=False, routed_scaling_factor=2.5)}


@pytest.mark.parametrize("changes", [{}, *CHECKPOINT_MOE.values()], ids=["preset", *CHECKPOINT_MOE])
def test_moe_matches_naive(changes: dict) -> None:
    """Fast MoE (per-expert padded GEMMs, ascending-id combine) vs per-token float64 reference: atol 1e-4; also
    with the checkpoints' variants (no latent, grouped top-k, unnormalised weights)."""
    moe = MoE(dataclasses.replace(CFG, **changes).validate())
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    x = torch.randn(37, CFG.d_model, generator=gen)
    fast = moe(pad_rows(x), 37)[:37]
    torch.testing.assert_close(fast, naive_moe(moe, x), rtol=1e-4, atol=1e-4)


def test_grouped_routing_picks_only_kept_groups() -> None:
    """Grouped top-k: every chosen expert lies in one of the topk_groups groups with the best top-2 sums."""
    cfg = dataclasses.replace(CFG, num_expert_groups=4, topk_groups=2).validate()
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = pad_rows(torch.randn(20, cfg.d_model, generator=gen))
    ids, _ = moe.route(x)
    biased = (torch.sigmoid(moe.router(x)) + moe.correction_bias).view(x.shape[0], 4, -1)
    best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    group_of = ids // (cfg.num_experts // 4)
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(group_of, best_groups))


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary", [Rotary(), Rotary(theta=50000.0, factor=40.0, original_context=64,
                                                       attention_factor=0.9)], ids=["rope", "yarn"])
def test_rope_matches_naive(style: str, rotary: Rotary) -> None:
    """apply_rope vs the complex-number float64 reference at positions below 1000: atol 2e-4 (fp32 angles are off
    by up to position * 2^-24 radians, as transformers' are)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, 3, 16, generator=gen)
    positions = torch.randint(0, 1000, (9,), generator=gen)
    torch.testing.assert_close(apply_rope(x, positions, style, rotary), naive_rope(x, positions, style, rotary),
                               rtol=0, atol=2e-4)
    assert torch.equal(apply_rope(x, positions, "none", rotary), x)


def test_moe_router_ties_go_to_lower_expert() -> None:
    moe = MoE(CFG)
    with torch.no_grad():
        for p in moe.parameters():
            p.zero_()
    ids, weights = moe.route(pad_rows(torch.randn(3, CFG.d_model)))
    assert ids[0].tolist() == list(range(CFG.num_experts_per_tok))
    torch.testing.assert_close(weights[0], torch.full((CFG.num_experts_per_tok,), 1 / CFG.num_experts_per_tok))


def test_fp8_rowwise_roundtrip_and_hadamard() -> None:
    x = torch.randn(5, 64)
    q, scale = fp8_quantize_rowwise(x)
    torch.testing.assert_close(fp8_to_float(q) * scale[:, None], x, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
    h = hadamard_matrix(64)
    torch.testing.assert_close(h @ h.t(), torch.eye(64), rtol=0, atol=1e-6)


def test_every_model_gemm_is_row_invariant() -> None:
    """The batch-invariance premise (numerics.py): for every 2-D weight of the model, x[:M] @ W^T rows are
    bit-identical for all M that are multiples of 16, in any order and beside any neighbours."""
    model = build_model(CFG)
    shapes = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and name != "embed":
            shapes.setdefault(tuple(p.shape), p)
    for name, p in model.named_parameters():
        if p.dim() == 3:  # stacked experts
            shapes.setdefault(tuple(p.shape[1:]), p[0])
    bad = {shape: check_row_invariance(w) for shape, w in shapes.items()}
    assert not any(bad.values()), bad
