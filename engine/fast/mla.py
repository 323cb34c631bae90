"""Sparse MLA decode in absorbed form over FP8 latents read in-kernel from the packed pages.

Per request b and head h (one query token), with c~ the FP8 latent bytes [c | k^R] of the selected positions:
    s_j = (q~_h . c~_j) * softmax_scale * latent_scale,   o^lat_h = latent_scale * sum_j softmax(s)_j c~_j[:kv_lora]
`sparse_mla_decode` splits the k selected keys of a request into `num_splits` ranges (one program per (request,
block of 16 heads, split): enough programs to fill the GPU at batch 1); each program streams its keys in tiles of
BLOCK_N, loading each token's latent row straight from its page (e4m3 -> bf16 is exact), scores all its heads on
tensor cores, keeps an online softmax in fp32 and accumulates o^lat in fp32; the splits are merged by their
log-sum-exp. The query and the probabilities enter the dots in bf16. Selected slots of -1 are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active
from engine.fast.dot import mm
from engine.fast.indexer import byte_alignment
from engine.fast.pages import PageBatch
from engine.layout import RowLayout
from engine.model.mla import sparse_mla_gathered
from engine.model.numerics import FP8_DTYPE, fp8_to_float

BLOCK_H = 16
BLOCK_N = 32
MIN_SPLIT_KEYS = 64
"""Fewest selected keys a split of one request scores (`choose_splits`). On one H200 (pro-rank b1 / 32K graphed
step) 64 took the kernel from 21 to 12 us per DSA layer against 128 (32: no faster); benchmarks/RESULTS.md."""
LOG2E = 1.4426950408889634
INTERPRETED_SMS = 1
"""What `choose_splits` takes for the SM count under the Triton interpreter, which runs programs one at a time on
one core, paying milliseconds of Python per program: a request at batch 1 still gets two splits (the merge runs),
larger batches one, where a GPU's 132 SMs would give each request up to topk / MIN_SPLIT_KEYS programs."""


@triton.jit
def _sparse_mla_kernel(q_ptr, pool_ptr, sb_ptr, sel_ptr, o_ptr, lse_ptr,
                       sb_stride, sel_stride, num_heads, topk, keys_per_split, latent_base, subblock_bytes,
                       latent_bytes, qk_scale,
                       C: tl.constexpr, R: tl.constexpr, B0: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                       SPLITS: tl.constexpr, ALIGN: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < num_heads
    cdim = tl.arange(0, C)
    rdim = tl.arange(0, R)
    q_row = (b * num_heads + heads).to(tl.int64) * (C + R)
    qc = tl.load(q_ptr + q_row[:, None] + cdim[None, :], mask=hmask[:, None], other=0.0)  # [BH, C] bf16
    qr = tl.load(q_ptr + q_row[:, None] + C + rdim[None, :], mask=hmask[:, None], other=0.0)  # [BH, R]
    m = tl.full([BH], float("-inf"), tl.float32)
    denom = tl.full([BH], 0.0, tl.float32)
    acc = tl.full([BH, C], 0.0, tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, topk)
    for k0 in range(start, end, BN):
        j = k0 + tl.arange(0, BN)
        tok = tl.load(sel_ptr + b * sel_stride + j, mask=j < end, other=-1)
        valid = tok >= 0
        tok = tl.where(valid, tok, 0)
        sb = tl.load(sb_ptr + b * sb_stride + tok // B0, mask=valid, other=0).to(tl.int64)
        base = sb * subblock_bytes + latent_base + (tok % B0).to(tl.int64) * latent_bytes
        base = tl.multiple_of(base, ALIGN)
        kc = tl.load(pool_ptr + base[:, None] + cdim[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)
        kr = tl.load(pool_ptr + base[:, None] + C + rdim[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)
        s = mm(qc, tl.trans(kc), INTERPRET) + mm(qr, tl.trans(kr), INTERPRET)  # [BH, BN] fp32
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p.to(tl.bfloat16), kc, INTERPRET)
        m = m_new
    has = denom > 0
    out = acc / tl.where(has, denom, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, denom, 1.0)), float("-inf"))
    o_row = ((b * num_heads + heads) * SPLITS + split).to(tl.int64)
    tl.store(o_ptr + o_row[:, None] * C + cdim[None, :], out, mask=hmask[:, None])
    tl.store(lse_ptr + o_row, lse, mask=hmask)


def choose_splits(batch: int, num_heads: int, topk: int, num_sms: int = 132) -> int:
    """Key splits per request: about two programs per SM, at least MIN_SPLIT_KEYS keys per split."""
    programs = batch * triton.cdiv(num_heads, BLOCK_H)
    splits = max(1, min(triton.cdiv(2 * num_sms, programs), topk // MIN_SPLIT_KEYS))
    return triton.next_power_of_2(splits) if splits > 1 else 1


def sparse_mla_decode(buffer: torch.Tensor, layout: RowLayout, pages: PageBatch, dsa_layer: int,
                      q_absorbed: torch.Tensor, selected: torch.Tensor, softmax_scale: float, latent_scale: float,
                      kv_lora_rank: int, num_splits: int | None = None, block_n: int = BLOCK_N,
                      num_warps: int | None = None, num_stages: int | None = None,
                      merge: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q_absorbed [B, H, kv_lora + rope] (any float; used as bf16), selected [B, k] int32 (-1 = unused) ->
    o^lat [B, H, kv_lora] float32. `block_n` (keys per tile), `num_warps`, `num_stages`: the kernel's launch
    shape (defaults: the decode step's). `merge=False` returns the splits unmerged, (partial [B, H, S, kv_lora],
    lse [B, H, S]), for `merge_splits` to run elsewhere (inside a compiled segment: engine/fast/decoder.py)."""
    batch, num_heads, width = q_absorbed.shape
    rope = width - kv_lora_rank
    topk = selected.shape[1]
    assert rope & (rope - 1) == 0 and kv_lora_rank & (kv_lora_rank - 1) == 0
    if num_splits is None:
        splits = choose_splits(batch, num_heads, topk, **({"num_sms": INTERPRETED_SMS} if interpreter_active() else {}))
    else:
        splits = num_splits
    per_split = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    q = q_absorbed.to(torch.bfloat16).contiguous()
    partial = torch.empty(batch, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=buffer.device)
    lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=buffer.device)
    grid = (batch, triton.cdiv(num_heads, BLOCK_H), splits)
    _sparse_mla_kernel[grid](
        q, buffer.view(-1).view(FP8_DTYPE), pages.subblock_ids, selected.contiguous(), partial, lse,
        pages.subblock_ids.stride(0), topk, num_heads, topk, per_split, dsa_layer * layout.layer_stride,
        layout.subblock_bytes, layout.latent_bytes, softmax_scale * latent_scale * LOG2E,
        C=kv_lora_rank, R=rope, B0=layout.subblock_tokens, BH=BLOCK_H, BN=block_n, SPLITS=splits,
        ALIGN=byte_alignment(layout.subblock_bytes, layout.layer_stride, layout.latent_bytes),
        INTERPRET=interpreter_active(), num_warps=num_warps or (8 if kv_lora_rank >= 256 else 4),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if not merge:
        return partial, lse
    return merge_splits(partial, lse, latent_scale)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, latent_scale: float) -> torch.Tensor:
    """The splits of `sparse_mla_decode` (partial [B, H, S, C] normalised per split, lse [B, H, S] base 2; -inf
    for a split without keys) merged by their log-sum-exp -> o^lat [B, H, C] fp32, times `latent_scale`."""
    if partial.shape[2] == 1:
        return partial[:, :, 0] * latent_scale
    return merge_splits_lse(partial, lse, latent_scale)[0]


def merge_splits_lse(partial: torch.Tensor, lse: torch.Tensor,
                     latent_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_splits` with the merged log-sum-exp: (o^lat [B, H, C], lse [B, H]) where lse is the natural log of
    sum_j exp(s_j) over every key of every split, s_j = (q~ . c~_j) * softmax_scale * latent_scale as the
    reference scores (the kernel's lse is base 2 of s_j * log2(e)); -inf with no keys. What a DCP rank's partial
    attention gives the cross-rank merge (engine/parallel/dcp_attention.py)."""
    top = lse.amax(-1, keepdim=True)
    weight = torch.exp2(lse - torch.where(top == float("-inf"), 0.0, top))  # [B, H, S]
    total = weight.sum(-1)
    merged = (partial * weight.unsqueeze(-1)).sum(2) / total.unsqueeze(-1).clamp_min(1e-30)
    lse2 = torch.where(total > 0, top.squeeze(-1) + torch.log2(total.clamp_min(1e-30)), float("-inf"))
    return merged * latent_scale, lse2 / LOG2E


def naive_sparse_mla_decode(latent_bytes: torch.Tensor, q_absorbed: torch.Tensor, selected: torch.Tensor,
                            softmax_scale: float, latent_scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Reference: engine.model.mla.sparse_mla_gathered on the dequantized latents (uint8 [B, L, C+R]) of the
    selected positions, in fp32."""
    sel = selected.long()
    rows = torch.arange(sel.shape[0]).unsqueeze(1)
    gathered = fp8_to_float(latent_bytes[rows, sel.clamp_min(0)]) * latent_scale
    return sparse_mla_gathered(q_absorbed.float(), gathered, sel, softmax_scale, kv_lora_rank)
