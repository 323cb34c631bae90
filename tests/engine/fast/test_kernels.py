"""Fast decode kernels (engine/fast) against their naive references, on packed pools with random contents.

Tolerances: index scores rtol 1e-5 (the fast dot sums d_I exact products in fp32, the reference in float64);
top-k sets equal except for positions whose reference score lies within that tolerance of the k-th score
(ties); sparse MLA and KDA outputs within 2e-2 of the output's scale (bf16 query/probabilities in the MLA dots)
and 1e-5 (KDA, fp32 throughout). CPU runs use the Triton interpreter on kimi-k3.1-mini shapes; the `gpu` case
runs K3.1 Pro's per-head shapes (kv_lora 512, rope 64, 32 x 128 index heads, top-k 2048) at 32K context.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.fast.indexer import (
    index_scores,
    index_topk,
    naive_index_scores,
    naive_select,
)
from engine.fast.kda import kda_conv_qkv_rows, kda_conv_step, kda_recurrent_step_rows
from engine.fast.mla import naive_sparse_mla_decode, sparse_mla_decode
from engine.fast.pages import write_token
from engine.layout import plan_layout
from engine.model.config import ModelConfig, get_preset
from engine.model.kda import causal_conv_step, kda_recurrent_step, l2_normalize
from engine.model.numerics import (
    fp8_quantize_rowwise,
    fp8_quantize_static,
    fp8_to_float,
)
from tests.engine.fast._pools import device_pages, filled_pool

MINI = get_preset("kimi-k3.1-mini")
PRO_SHAPES = dataclasses.replace(
    MINI, name="pro-shapes", num_heads=12, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
    index_num_heads=32, index_head_dim=128, index_topk=2048, max_context=65536,
)


def _queries(cfg: ModelConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_bytes, _ = fp8_quantize_rowwise(torch.randn(batch, cfg.index_num_heads, cfg.index_head_dim, generator=gen))
    return fp8_to_float(q_bytes), torch.rand(batch, cfg.index_num_heads, generator=gen) * 0.1


def _reference_rows(pool, tables, layer: int, lengths: list[int]):  # type: ignore[no-untyped-def]
    cached = pool.read_attention_padded(tables, layer, lengths)  # padded to whole pages: cut to the longest
    n = max(lengths)
    return type(cached)(cached.latent[:, :n], cached.index_key[:, :n], cached.index_scale[:, :n])


def _check_selection(fast: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, rtol: float) -> None:
    for b in range(fast.shape[0]):
        got = set(fast[b][fast[b] >= 0].tolist())
        want = set(ref[b][ref[b] >= 0].tolist())
        if len(want) < ref.shape[1]:  # every key kept
            assert got == want
            continue
        thresh = float(scores[b, ref[b]].min())
        for pos in got ^ want:
            assert abs(float(scores[b, pos]) - thresh) <= rtol * abs(thresh) + 1e-12, (b, pos)


def _indexer_case(cfg: ModelConfig, lengths: list[int], layer: int, device: torch.device) -> None:
    pool, tables = filled_pool(cfg, lengths, seed=len(lengths))
    positions = [n - 1 for n in lengths]
    buffer, pages = device_pages(pool, tables, positions, device)
    q, w = _queries(cfg, len(lengths), seed=1)
    fast = index_scores(buffer, pool.layout, pages, layer, q.to(device), w.to(device)).cpu()
    cached = _reference_rows(pool, tables, layer, lengths)
    ref = naive_index_scores(cached.index_key, cached.index_scale, q, w, torch.tensor(positions))
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(fast))
    torch.testing.assert_close(fast[finite], ref[finite], rtol=1e-5, atol=1e-6)
    pos = torch.tensor(positions)
    selected = index_topk(fast.to(device), pos.to(device, torch.int32), cfg.index_topk).cpu()
    _check_selection(selected, naive_select(ref, pos, cfg.index_topk), ref, rtol=1e-5)


def _mla_case(cfg: ModelConfig, lengths: list[int], layer: int, device: torch.device, splits: int | None) -> None:
    pool, tables = filled_pool(cfg, lengths, seed=7)
    positions = [n - 1 for n in lengths]
    buffer, pages = device_pages(pool, tables, positions, device)
    gen = torch.Generator().manual_seed(3)
    q_abs = torch.randn(len(lengths), cfg.num_heads, cfg.latent_dim, generator=gen)
    cached = _reference_rows(pool, tables, layer, lengths)
    scores = torch.randn(len(lengths), max(lengths), generator=gen)
    selected = naive_select(scores, torch.tensor(positions), cfg.index_topk)
    scale, lat_scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5, cfg.latent_fp8_scale
    perm = torch.randperm(selected.shape[1], generator=gen)  # the kernel must not depend on the order
    fast = sparse_mla_decode(buffer, pool.layout, pages, layer, q_abs.to(device),
                             selected[:, perm].to(device, torch.int32), scale, lat_scale, cfg.kv_lora_rank,
                             num_splits=splits).cpu()
    q_bf16 = q_abs.to(torch.bfloat16).float()  # the kernel's query precision
    ref = naive_sparse_mla_decode(cached.latent, q_bf16, selected, scale, lat_scale, cfg.kv_lora_rank)
    torch.testing.assert_close(fast, ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("lengths", [[200, 700, 1500], [1300]], ids=["mixed-short-long", "one-long"])
def test_index_scores_and_topk_match_reference(lengths, device) -> None:  # type: ignore[no-untyped-def]
    _indexer_case(MINI, lengths, layer=1, device=device)


@pytest.mark.parametrize("splits", [1, 4, None], ids=["one-split", "four-splits", "auto"])
def test_sparse_mla_decode_matches_reference(splits, device) -> None:  # type: ignore[no-untyped-def]
    _mla_case(MINI, [100, 900, 1500], layer=0, device=device, splits=splits)


def test_kda_step_in_rows_matches_reference(device) -> None:  # type: ignore[no-untyped-def]
    cfg = MINI
    pool, tables = filled_pool(cfg, [10, 20], seed=5)
    buffer, pages = device_pages(pool, tables, [9, 19], device)
    lay, kda_index = pool.layout, 4  # group 1, layer 1 in the group
    group, li = divmod(kda_index, lay.kda_layers_per_group)
    before = pool.read_kda_batch(tables, kda_index)
    gen = torch.Generator().manual_seed(2)
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    x = torch.randn(2, 3 * h * d, generator=gen)
    weight = torch.randn(3 * h * d, cfg.kda_conv_size, generator=gen) * 0.5
    g = -torch.rand(2, h, d, generator=gen)
    beta = torch.rand(2, h, generator=gen)
    rows = pages.kda_row_ids[:, group].contiguous()
    conv_fast = kda_conv_step(buffer, lay, rows, li, x.to(device), weight.to(device), torch.float32).cpu()
    conv_ref, conv_state = causal_conv_step(x, before.conv, weight)
    torch.testing.assert_close(conv_fast, conv_ref, rtol=1e-5, atol=1e-5)
    q, k, v = (conv_ref.view(2, 3, h, d)[:, i] for i in range(3))
    o_fast = kda_recurrent_step_rows(buffer, lay, rows, li, q.to(device), k.to(device), v.to(device),
                                     g.to(device), beta.to(device)).cpu()
    o_ref, s_ref = kda_recurrent_step(q, k, v, g, beta, before.recurrent)
    torch.testing.assert_close(o_fast, o_ref, rtol=1e-5, atol=1e-5)
    pool.buffer.copy_(buffer.cpu())
    after = pool.read_kda_batch(tables, kda_index)
    torch.testing.assert_close(after.recurrent, s_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after.conv, conv_state, rtol=0, atol=0)


def test_write_token_matches_row_pool(device) -> None:  # type: ignore[no-untyped-def]
    cfg = MINI
    pool, tables = filled_pool(cfg, [70, 1030], seed=9)
    buffer, pages = device_pages(pool, tables, [70, 1030], device)
    gen = torch.Generator().manual_seed(4)
    latent = fp8_quantize_static(torch.randn(2, cfg.latent_dim, generator=gen), cfg.latent_fp8_scale)
    keys, scales = fp8_quantize_rowwise(torch.randn(2, cfg.index_head_dim, generator=gen))
    write_token(buffer, pool.layout, pages, 1, latent.to(device), keys.to(device), scales.to(device))
    pool.write_attention_tokens(tables, 1, [70, 1030], latent, keys, scales)
    assert torch.equal(buffer.cpu(), pool.buffer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="K3.1 Pro per-head shapes at 32K context need a GPU")
def test_pro_shapes_on_gpu(device) -> None:  # type: ignore[no-untyped-def]
    _indexer_case(PRO_SHAPES, [1000, 32768, 20000], layer=1, device=device)
    _mla_case(PRO_SHAPES, [1000, 32768, 20000], layer=1, device=device, splits=None)


@pytest.mark.parametrize("conv_bytes", [4, 2], ids=["fp32-state", "bf16-state"])
def test_fused_conv_step_matches_torch_conv_and_norms(conv_bytes, device) -> None:  # type: ignore[no-untyped-def]
    """kda_conv_qkv_rows == kda_conv_step + l2 norms (within fp32 rounding: the taps add in another order); the
    shifted conv states are the same bits."""
    cfg = dataclasses.replace(MINI, conv_state_bytes=conv_bytes)
    conv_dtype = {4: torch.float32, 2: torch.bfloat16}[conv_bytes]
    lay, li = plan_layout(cfg), 1
    gen = torch.Generator().manual_seed(6)
    values = torch.randn(5 * lay.row_bytes // conv_bytes, generator=gen).to(conv_dtype)  # 5 rows of states
    buffer = values.view(torch.uint8).view(5, lay.row_bytes).to(device)
    rows = torch.tensor([3, 0, 4], device=device)
    gen = torch.Generator().manual_seed(6)
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    x = torch.randn(3, 3 * h * d, generator=gen)
    weight = torch.randn(3 * h * d, cfg.kda_conv_size, generator=gen) * 0.5
    torch_buffer = buffer.clone()
    conv = kda_conv_step(torch_buffer, lay, rows, li, x.to(device), weight.to(device), conv_dtype)
    q, k, v = conv.view(3, 3, h, d).unbind(1)
    want = (l2_normalize(q) * d**-0.5, l2_normalize(k), v)
    got = kda_conv_qkv_rows(buffer, lay, rows, li, x.to(device), weight.to(device), conv_dtype)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(buffer.cpu(), torch_buffer.cpu())


@pytest.mark.parametrize("conv_bytes", [4, 2], ids=["fp32-state", "bf16-state"])
def test_kda_kernels_give_the_same_bits_at_every_launch_shape(  # type: ignore[no-untyped-def]
        conv_bytes, device, monkeypatch) -> None:
    """The conv and recurrent-step kernels at the launch a GPU runs (a head and BLOCK_V value dims per program)
    and at the interpreter's (every head and value dim of a request per program): the same outputs and row
    states, bit for bit, for heads that fill their program's block and heads that do not (3 of 4)."""
    from engine.fast import kda as module

    if device.type == "cuda":  # a GPU never runs the wide launch, and its compiled sums may run in another order
        pytest.skip("the wide launch is the Triton interpreter's (numpy sums each head's elements in one order)")
    for heads in (MINI.kda_num_heads, 3):
        cfg = dataclasses.replace(MINI, conv_state_bytes=conv_bytes, kda_num_heads=heads)
        conv_dtype = {4: torch.float32, 2: torch.bfloat16}[conv_bytes]
        lay, li = plan_layout(cfg), 1
        gen = torch.Generator().manual_seed(11)
        rows = torch.tensor([2, 0, 3], device=device)
        d = cfg.kda_head_dim
        start = torch.randn(4 * lay.row_bytes // conv_bytes, generator=gen).to(conv_dtype).view(torch.uint8).view(
            4, lay.row_bytes)
        x = torch.randn(3, 3 * heads * d, generator=gen).to(device)
        weight = (torch.randn(3 * heads * d, cfg.kda_conv_size, generator=gen) * 0.5).to(device)
        g = -torch.rand(3, heads, d, generator=gen).to(device)
        beta = torch.rand(3, heads, generator=gen).to(device)
        results = []
        for wide in (True, False):
            monkeypatch.setattr(module, "interpreter_active", lambda wide=wide: wide)
            buffer = start.clone().to(device)
            q, k, v = kda_conv_qkv_rows(buffer, lay, rows, li, x, weight, conv_dtype)
            o = kda_recurrent_step_rows(buffer, lay, rows, li, q, k, v, g, beta)
            results.append([t.cpu() for t in (q, k, v, o, buffer)])
        for wide_t, gpu_t in zip(*results):
            assert torch.equal(wide_t.contiguous().view(torch.uint8), gpu_t.contiguous().view(torch.uint8))


def test_expert_gemv_matches_per_slot_reference(device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Few-token routed experts read in place: within bf16 rounding of the fp32 per-slot reference (the hidden
    vector and the output are rounded to bf16 once each); shapes not multiples of the kernels' blocks. The rows
    per gate/up program change no bit (the interpreter runs wide blocks: INTERPRETED_ROWS)."""
    from engine.fast import expert_gemv as module
    from engine.fast.expert_gemv import expert_gemv, naive_expert_gemv

    gen = torch.Generator().manual_seed(8)
    experts, inter, lat, batch, top_k = 6, 40, 600, 2, 2
    w1, w3 = (torch.randn(experts, inter, lat, generator=gen).mul(lat**-0.5).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(experts, lat, inter, generator=gen).mul(inter**-0.5).to(torch.bfloat16)
    z = torch.randn(batch, lat, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[4, 1], [1, 5]])
    got = expert_gemv(*(t.to(device) for t in (z, ids, w1, w3, w2))).float().cpu()
    want = naive_expert_gemv(z, ids, w1, w3, w2)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))
    monkeypatch.setattr(module, "INTERPRETED_ROWS", 1)  # the launch a GPU runs (TUNE's blocks)
    assert torch.equal(expert_gemv(*(t.to(device) for t in (z, ids, w1, w3, w2))).float().cpu(), got)


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 100, 384), (1, 40, 4096), (1, 8450, 256), (2, 8300, 128),
                                             (3, 64, 4096), (8, 257, 1536), (5, 16, 5120)],
                         ids=["one-row", "one-row-split-k", "one-row-one-slice", "rows-one-slice", "split-k",
                              "eight-rows", "few-features-long-k"])
def test_gemv_matches_float64_reference(rows, n, k, device) -> None:  # type: ignore[no-untyped-def]
    """The few-row linear: within one bf16 rounding of the float64 sum of the same bf16 products (the kernel sums
    in fp32, then rounds once), shapes not multiples of its blocks, one and several K slices; the split-K sum
    does not depend on scheduling (two calls are bit-equal)."""
    from engine.fast.gemv import GEMV_MAX_ROWS, gemv, naive_gemv, plan

    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen).mul(k**-0.5).to(torch.bfloat16)
    got = gemv(x.to(device), w.to(device))
    want = naive_gemv(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2**-7, atol=1e-3)
    assert torch.equal(gemv(x.to(device), w.to(device)), got)
    wide = torch.zeros(rows, k + 256)
    wide[:, 128 : 128 + k] = x  # a column slice (rows strided), as a split of a fused projection's output
    assert torch.equal(gemv(wide.to(device)[:, 128 : 128 + k], w.to(device)), got)
    assert torch.equal(gemv(x.to(device).to(torch.bfloat16), w.to(device)), got)  # bf16 input: the same rounding
    if k >= 4096:
        assert plan(rows, n, k)[2] > 1  # the case exercises the K slices and their ordered sum
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(GEMV_MAX_ROWS + 1, k, device=device), w.to(device))
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(rows, 100, device=device), torch.zeros(n, 100, dtype=torch.bfloat16, device=device))


def test_gemv_interpreter_feature_blocks_change_no_bit(device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A one-row call in wide feature blocks (the interpreter's INTERPRETED_FEATURES) gives the bits of the launch
    a GPU runs (plan's blocks and K slices), split K included."""
    from engine.fast import gemv as module

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1024, generator=gen)
    w = torch.randn(300, 1024, generator=gen).mul(1024**-0.5).to(torch.bfloat16)
    assert module.plan(1, 300, 1024)[2] > 1
    wide = module.gemv(x.to(device), w.to(device))
    monkeypatch.setattr(module, "INTERPRETED_FEATURES", 1)
    assert torch.equal(module.gemv(x.to(device), w.to(device)), wide)


def test_gemv_tuning_knob_rejects_unknown_settings() -> None:
    """PDCLUSTER_GEMV_TUNE overrides the launch defaults by name; a misspelt name or a non-integer is an error,
    not a setting silently ignored."""
    from engine.fast.gemv import _tuning

    assert _tuning("")["one_bn"] == 8
    assert _tuning("one_bn=32, warps=8") | {} == dict(_tuning(""), one_bn=32, warps=8)
    for bad in ("one_bm=32", "warps=eight", "warps"):
        with pytest.raises(ValueError, match="PDCLUSTER_GEMV_TUNE"):
            _tuning(bad)
