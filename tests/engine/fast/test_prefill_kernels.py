"""Fast prefill kernels (engine/fast/prefill_attention.py, prefill_kda.py, moe.py) against their naive references.

Tolerances: index scores rtol 1e-5 plus 1e-5 of the largest score (bf16 operands: fp32 sums of exact products
vs float64; a dot that cancels keeps an absolute, not a relative, error), 2e-3 with FP8 x FP8 dots on CUDA
(Hopper's FP8 MMA accumulates with fewer mantissa bits); top-k sets equal except for positions whose reference
score lies within 1e-4 (CPU; 2e-3 on CUDA, FP8 dots) of the k-th score (ties); page writes byte-exact;
sparse MLA within 2e-2 of the output's scale (bf16 query and probabilities in the dots); KDA conv exact-order
fp32 (1e-5) and the recurrence 1e-4 through the Triton recurrence (CPU interpreter), 3e-2 of the output's scale
through fla-core's chunk_kda (GPU: bf16 q, k, v); grouped experts within 1e-5 (fp32 weights) of the per-expert
loop. CPU runs use the Triton interpreter on kimi-k3.1-mini shapes; the `gpu` case runs K3.1 Pro's per-head
shapes (512 queries over 4K keys; MLA 256 queries) and fla's chunk_kda at d = 128.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.fast.moe import grouped_experts, naive_grouped_experts
from engine.fast.prefill import request_subblocks
from engine.fast.prefill_attention import (
    naive_prefill_index_scores,
    naive_prefill_select,
    naive_sparse_mla_prefill,
    prefill_index_scores,
    prefill_select,
    sparse_mla_prefill,
    write_tokens,
)
from engine.fast.prefill_kda import (
    has_fla,
    kda_conv_prefill,
    kda_prefill_core,
    kda_state_views,
    naive_kda_prefill,
)
from engine.model.config import ModelConfig, get_preset
from engine.model.kda import causal_conv, l2_normalize
from engine.model.numerics import fp8_quantize_rowwise, fp8_quantize_static
from tests.engine.fast._pools import filled_pool
from tests.engine.fast.test_kernels import PRO_SHAPES, _check_selection, _queries

MINI = get_preset("kimi-k3.1-mini")


def _request(cfg: ModelConfig, length: int, device: torch.device, seed: int = 0):  # type: ignore[no-untyped-def]
    """A pool holding one request of `length` random cached tokens: (pool, table, buffer on device, sub-blocks)."""
    pool, tables = filled_pool(cfg, [length], seed=seed)
    return pool, tables[0], pool.buffer.to(device), request_subblocks(pool.layout, tables[0].attn_row_ids,
                                                                      length, device)


def test_write_tokens_matches_row_pool(device) -> None:  # type: ignore[no-untyped-def]
    cfg = MINI
    pool, table, buffer, subblocks = _request(cfg, 1100, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    start, count = 37, 1000  # crosses sub-block and row boundaries
    latent = fp8_quantize_static(torch.randn(count, cfg.latent_dim, generator=gen), cfg.latent_fp8_scale)
    keys, scales = fp8_quantize_rowwise(torch.randn(count, cfg.index_head_dim, generator=gen))
    write_tokens(buffer, pool.layout, subblocks, 1, start, latent.to(device), keys.to(device), scales.to(device))
    pool.write_attention(table, 1, start, latent, keys, scales)
    assert torch.equal(buffer.cpu(), pool.buffer)


def _index_case(cfg: ModelConfig, length: int, first_pos: int, device: torch.device, score_bytes: int,
                fp8_dot: bool = False) -> None:
    pool, table, buffer, subblocks = _request(cfg, length, device, seed=length)
    num_queries = length - first_pos
    q, w = _queries(cfg, num_queries, seed=1)
    cached = pool.read_attention(table, 1, length)
    ref = naive_prefill_index_scores(cached.index_key, cached.index_scale, q, w, first_pos)
    fast = prefill_index_scores(buffer, pool.layout, subblocks, 1, first_pos, q.to(device), w.to(device),
                                fp8_dot=fp8_dot).cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(fast))
    tol = 2e-3 if fp8_dot else 1e-5  # Hopper's FP8 MMA accumulates with fewer mantissa bits than fp32
    torch.testing.assert_close(fast[finite], ref[finite], rtol=tol, atol=tol * float(ref[finite].abs().max()))
    if fp8_dot:  # the selection path below runs the default (FP8 on CUDA)
        return
    selected = prefill_select(buffer, pool.layout, subblocks, 1, first_pos, q.to(device), w.to(device),
                              cfg.index_topk, score_bytes=score_bytes).cpu()
    sel_tol = 2e-3 if device.type == "cuda" else 1e-4
    _check_selection(selected, naive_prefill_select(ref, first_pos, cfg.index_topk), ref, rtol=sel_tol)


@pytest.mark.parametrize(("length", "first_pos"), [(400, 0), (480, 400)], ids=["from-start", "resumed"])
def test_prefill_index_scores_and_topk_match_reference(length, first_pos, device) -> None:  # type: ignore[no-untyped-def]
    _index_case(MINI, length, first_pos, device, score_bytes=64 * 4 * length)  # chunks of 64 queries


def _mla_case(cfg: ModelConfig, length: int, num_queries: int, device: torch.device) -> None:
    pool, table, buffer, subblocks = _request(cfg, length, device, seed=7)
    gen = torch.Generator().manual_seed(3)
    q_abs = torch.randn(num_queries, cfg.num_heads, cfg.latent_dim, generator=gen)
    first_pos = length - num_queries
    scores = torch.randn(num_queries, length, generator=gen)
    selected = naive_prefill_select(scores, first_pos, cfg.index_topk)
    scale, lat_scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5, cfg.latent_fp8_scale
    fast = sparse_mla_prefill(buffer, pool.layout, subblocks, 0, q_abs.to(device), selected.to(device, torch.int32),
                              scale, lat_scale, cfg.kv_lora_rank).cpu()
    latent = pool.read_attention(table, 0, length).latent
    ref = naive_sparse_mla_prefill(latent, q_abs.to(torch.bfloat16).float(), selected, scale, lat_scale,
                                   cfg.kv_lora_rank)
    torch.testing.assert_close(fast, ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


def test_sparse_mla_prefill_matches_reference(device) -> None:  # type: ignore[no-untyped-def]
    # top-k 128 (mini's 256 selects only past 256 tokens): queries 112..159 are both all-keys rows (-1 padded) and
    # selected rows, and every row of 128 selected keys spans two of the kernel's 64-key tiles
    _mla_case(dataclasses.replace(MINI, index_topk=128), 160, 48, device)


def _kda_inputs(heads: int, dim: int, num_tokens: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_tokens, heads, dim, generator=gen)) * dim**-0.5
    k = l2_normalize(torch.randn(num_tokens, heads, dim, generator=gen))
    v = torch.randn(num_tokens, heads, dim, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(num_tokens, heads, dim, generator=gen))
    beta = torch.rand(num_tokens, heads, generator=gen)
    return q, k, v, g, beta


def test_kda_prefill_on_rows_matches_reference(device) -> None:  # type: ignore[no-untyped-def]
    cfg = MINI
    pool, tables = filled_pool(cfg, [10], seed=5)
    lay, table, kda_index = pool.layout, tables[0], 4  # group 1, layer 1 in the group
    group, li = divmod(kda_index, lay.kda_layers_per_group)
    before = pool.read_kda(table, kda_index)
    buffer = pool.buffer.to(device)
    rec, conv = kda_state_views(buffer, lay, table.kda_row_ids[group], li, torch.float32)
    h, d, num_tokens = cfg.kda_num_heads, cfg.kda_head_dim, 70
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, 3 * h * d, generator=gen)
    weight = torch.randn(3 * h * d, cfg.kda_conv_size, generator=gen) * 0.5
    y = kda_conv_prefill(conv, x.to(device), weight.to(device)).cpu()
    y_ref, conv_ref = causal_conv(x, before.conv, weight)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    q, k, v, g, beta = _kda_inputs(h, d, num_tokens, seed=6)
    o, final = kda_prefill_core(*(t.to(device) for t in (q, k, v, g, beta)), rec, use_fla=False)
    rec.copy_(final)
    o_ref, s_ref = naive_kda_prefill(q, k, v, g, beta, before.recurrent)
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-4, atol=1e-4)
    pool.buffer.copy_(buffer.cpu())
    after = pool.read_kda(table, kda_index)
    torch.testing.assert_close(after.recurrent, s_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after.conv, conv_ref, rtol=0, atol=0)


def test_grouped_experts_match_per_expert_loop(device) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(8)
    num_tokens, experts, k, lat, inter = 100, 8, 3, 32, 16
    z = torch.randn(num_tokens, lat, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(num_tokens)])
    ids[:40] = torch.tensor([0, 1, 2])  # unbalanced: expert 0..2 busiest
    weights = torch.rand(num_tokens, k, generator=gen)
    w1, w3 = torch.randn(experts, inter, lat, generator=gen), torch.randn(experts, inter, lat, generator=gen)
    w2 = torch.randn(experts, lat, inter, generator=gen)
    fast = grouped_experts(*(t.to(device) for t in (z, ids, weights, w1, w3, w2))).cpu()
    ref = naive_grouped_experts(z, ids, weights, w1, w3, w2)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="K3.1 Pro per-head shapes and fla's chunk_kda need a GPU")
def test_pro_shapes_prefill_on_gpu(device) -> None:  # type: ignore[no-untyped-def]
    _index_case(PRO_SHAPES, 4096, 3584, device, score_bytes=1 << 24, fp8_dot=True)
    _index_case(PRO_SHAPES, 4096, 3584, device, score_bytes=1 << 24)
    _mla_case(PRO_SHAPES, 4096, 256, device)
    if not has_fla():
        pytest.skip("fla-core is not installed: the chunked KDA case needs it")
    heads, dim = 4, 128
    q, k, v, g, beta = _kda_inputs(heads, dim, 1000, seed=9)
    state = torch.randn(heads, dim, dim, generator=torch.Generator().manual_seed(1)) * 0.1
    o, final = kda_prefill_core(*(t.to(device) for t in (q, k, v, g, beta, state)), use_fla=True)
    o_ref, s_ref = naive_kda_prefill(q, k, v, g, beta, state)
    torch.testing.assert_close(o.cpu(), o_ref, rtol=0, atol=3e-2 * float(o_ref.abs().max()))
    torch.testing.assert_close(final.cpu(), s_ref, rtol=0, atol=3e-2 * float(s_ref.abs().max()))
