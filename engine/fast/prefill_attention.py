"""MLA + DSA for a prefill of T tokens of one request on the packed pages: page writes, the causal indexer,
top-k, and sparse MLA over the selected FP8 latents.

One request's page table (engine/fast/pages.py) addresses every DSA layer: request token t of layer l sits in
sub-block `subblock_ids[t // b0]`. The new tokens (positions start..start+T-1) are written first
(`write_tokens`, the bytes `RowPool.write_attention` writes), so scoring and attention read every key, old
(a resumed prefix) or new, from the pages alike.

`prefill_index_scores` (Triton, one program per (block of BQ queries, block of BK keys)): loads the key block's
FP8 bytes and fp32 scales from the index pages once, then for each indexer head h a [BQ, D] x [D, BK] dot on
tensor cores (FP8 x FP8 on CUDA, or both widened to bf16, which is exact; products are exact in the fp32
accumulator; only the sum over D rounds, where the reference sums in float64) and accumulates
    I[q, t] = scale_t * sum_h w[q, h] * ReLU(q_h . k_t)          for t <= pos(q), -inf after
in the reference's head order. Tiles wholly above the causal diagonal skip the dots.
`prefill_select` runs it over chunks of queries (the score matrix of a chunk stays under SCORE_BYTES) and takes
each query's top-k with torch.topk (`indexer.index_topk`: queries with pos + 1 <= k keep every earlier key).
Ties at the k-th score follow torch.topk, not the reference's lower-position rule.

`sparse_mla_prefill`: the decode kernel (`mla._sparse_mla_kernel`, absorbed form) with one query token per
"request": the page table is the request's own, repeated with a row stride of 0; launched with the prefill's
own tile shape (PREFILL_MLA_*).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active
from engine.fast.dot import mm
from engine.fast.indexer import byte_alignment, index_topk, pad_heads
from engine.fast.mla import sparse_mla_decode
from engine.fast.pages import PageBatch
from engine.layout import RowLayout
from engine.model.indexer import index_scores as reference_index_scores
from engine.model.indexer import select_topk
from engine.model.mla import sparse_mla
from engine.model.numerics import FP8_DTYPE, fp8_to_float

BLOCK_Q = 64
PREFILL_MLA_BLOCK_N, PREFILL_MLA_WARPS, PREFILL_MLA_STAGES = 64, 4, 2
"""Launch shape of the sparse MLA kernel in a prefill (one query token per program, T programs): 64-key tiles,
4 warps, 2 stages took 35.2 ms for 32K tokens of K3.1 Pro shapes on an H200 against 45.6 ms with the decode
step's 32 keys and 8 warps (benchmarks/RESULTS.md, 2026-12-03 late)."""
BLOCK_K = 128
SCORE_BYTES = 1 << 30
"""Upper bound of one query chunk's fp32 score matrix [chunk, keys]."""


def page_view(buffer: torch.Tensor, layout: RowLayout, dsa_layer: int, index: bool) -> torch.Tensor:
    """Strided view [num_sub_blocks, b0, bytes_per_token] of one page kind of one DSA layer over the pool."""
    per_token = layout.index_bytes if index else layout.latent_bytes
    offset = dsa_layer * layout.layer_stride + (layout.latent_page_bytes if index else 0)
    num_sb = buffer.shape[0] * layout.subblocks_per_row
    return buffer.view(-1).as_strided((num_sb, layout.subblock_tokens, per_token),
                                      (layout.subblock_bytes, per_token, 1), offset)


def write_tokens(buffer: torch.Tensor, layout: RowLayout, subblock_ids: torch.Tensor, dsa_layer: int, start: int,
                 latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor) -> None:
    """Store T tokens at positions start..start+T-1 of one request (page table `subblock_ids` [P] int32):
    latent [T, C] uint8, index_key [T, D] uint8, index_scale [T] float32 (as RowPool.write_attention)."""
    num_tokens = latent.shape[0]
    b0 = layout.subblock_tokens
    pos = torch.arange(start, start + num_tokens, device=buffer.device)
    sb, tok = subblock_ids.long()[pos // b0], pos % b0
    page_view(buffer, layout, dsa_layer, index=False)[sb, tok] = latent
    entry = torch.cat([index_key, index_scale.contiguous().view(torch.uint8).view(num_tokens, 4)], dim=1)
    page_view(buffer, layout, dsa_layer, index=True)[sb, tok] = entry


@triton.jit
def _prefill_index_kernel(pool8_ptr, pool32_ptr, sb_ptr, q_ptr, w_ptr, out_ptr,
                          first_pos, num_queries, num_keys, index_base, subblock_bytes, index_bytes,
                          H: tl.constexpr, D: tl.constexpr, B0: tl.constexpr, BQ: tl.constexpr,
                          BK: tl.constexpr, ALIGN: tl.constexpr, FP8_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    qb = tl.program_id(0)
    kb = tl.program_id(1)
    qi = qb * BQ + tl.arange(0, BQ)  # query rows of this chunk
    qmask = qi < num_queries
    qpos = first_pos + qi
    n = kb * BK + tl.arange(0, BK)  # key positions
    kmask = n < num_keys
    last_q = first_pos + tl.minimum(qb * BQ + BQ, num_queries) - 1
    acc = tl.full([BQ, BK], 0.0, tl.float32)
    scale = tl.full([BK], 0.0, tl.float32)
    if kb * BK <= last_q:
        sb = tl.load(sb_ptr + n // B0, mask=kmask, other=0).to(tl.int64)
        base = sb * subblock_bytes + index_base + (n % B0).to(tl.int64) * index_bytes
        base = tl.multiple_of(base, ALIGN)
        dims = tl.arange(0, D)
        keys = tl.load(pool8_ptr + base[:, None] + dims[None, :], mask=kmask[:, None], other=0.0)
        if FP8_DOT:
            keys_t = tl.trans(keys)  # [D, BK] e4m3
        else:
            keys_t = tl.trans(keys.to(tl.bfloat16))
        scale = tl.load(pool32_ptr + (base + D) // 4, mask=kmask, other=0.0)
        rows = qi.to(tl.int64) * H
        for h in range(H):  # fixed head order, as the reference
            qh = tl.load(q_ptr + (rows + h)[:, None] * D + dims[None, :], mask=qmask[:, None], other=0.0)
            wh = tl.load(w_ptr + rows + h, mask=qmask, other=0.0)
            if FP8_DOT:
                dots = tl.dot(qh, keys_t)  # fp8 x fp8 -> fp32 on tensor cores
            else:
                dots = mm(qh, keys_t, INTERPRET)  # [BQ, BK] fp32
            acc += tl.maximum(dots, 0.0) * wh[:, None]
    score = acc * scale[None, :]
    keep = (n[None, :] <= qpos[:, None]) & kmask[None, :]
    score = tl.where(keep, score, float("-inf"))
    out = out_ptr + qi.to(tl.int64)[:, None] * num_keys + n[None, :]
    tl.store(out, score, mask=qmask[:, None] & kmask[None, :])


def prefill_index_scores(buffer: torch.Tensor, layout: RowLayout, subblock_ids: torch.Tensor, dsa_layer: int,
                         first_pos: int, q: torch.Tensor, weights: torch.Tensor,
                         fp8_dot: bool | None = None, num_keys: int | None = None) -> torch.Tensor:
    """Scores [Tq, num_keys] of queries at positions first_pos.. against the request's keys 0.. read from
    the pages, -inf past each query's position. q [Tq, H_I, D] e4m3-valued, weights [Tq, H_I]. `fp8_dot`
    (default: on CUDA) multiplies e4m3 queries and keys on the FP8 tensor cores (the same exact products).
    `num_keys` (default first_pos + Tq, the keys the queries can see) may be larger: the columns past every
    query's position are -inf, no dots run for them."""
    qp, wp = pad_heads(q, weights)
    if fp8_dot is None:
        fp8_dot = buffer.is_cuda and not interpreter_active()
    qp = qp.to(FP8_DTYPE if fp8_dot else torch.bfloat16).contiguous()  # e4m3 values: exact either way
    num_queries, heads, dim = qp.shape
    num_keys = first_pos + num_queries if num_keys is None else num_keys
    if num_keys < first_pos + num_queries:
        raise ValueError(f"{num_keys} key columns cannot hold queries up to position {first_pos + num_queries - 1}")
    assert dim & (dim - 1) == 0 and layout.index_bytes % 4 == 0 and layout.subblock_bytes % 4 == 0
    out = torch.empty(num_queries, num_keys, dtype=torch.float32, device=buffer.device)
    flat = buffer.view(-1)
    grid = (triton.cdiv(num_queries, BLOCK_Q), triton.cdiv(num_keys, BLOCK_K))
    _prefill_index_kernel[grid](
        flat.view(FP8_DTYPE), flat.view(torch.float32), subblock_ids, qp, wp, out,
        first_pos, num_queries, num_keys, dsa_layer * layout.layer_stride + layout.latent_page_bytes,
        layout.subblock_bytes, layout.index_bytes, H=heads, D=dim, B0=layout.subblock_tokens, BQ=BLOCK_Q,
        BK=BLOCK_K, ALIGN=byte_alignment(layout.subblock_bytes, layout.layer_stride, layout.latent_page_bytes,
                                         layout.index_bytes),
        FP8_DOT=fp8_dot, INTERPRET=interpreter_active(), num_warps=8,
    )
    return out


def query_chunk(num_keys: int, score_bytes: int = SCORE_BYTES) -> int:
    """Queries per chunk so that a chunk's [chunk, num_keys] fp32 scores stay under score_bytes."""
    return max(BLOCK_Q, score_bytes // (4 * max(num_keys, 1)) // BLOCK_Q * BLOCK_Q)


def prefill_select(buffer: torch.Tensor, layout: RowLayout, subblock_ids: torch.Tensor, dsa_layer: int,
                   start: int, q: torch.Tensor, weights: torch.Tensor, topk: int,
                   score_bytes: int = SCORE_BYTES, num_keys: int | None = None) -> torch.Tensor:
    """The indexer of a prefill of T tokens at positions start..start+T-1 -> [T, k] int32 selected positions
    (unsorted, -1 padded). Queries whose position + 1 <= k need no scores: they keep every earlier key.
    `num_keys` (default start + T): the width of the score rows top-k runs on. Which of several keys with equal
    scores top-k keeps depends on that width, so a query scored in a piece of the prompt (the token-sharded
    prefill) gets the selection of the one-shot prefill when its rows are as wide: the prompt's key count."""
    num_tokens = q.shape[0]
    device = buffer.device
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    positions = torch.arange(start, start + num_tokens, device=device, dtype=torch.int32)
    lo = 0
    full_until = max(0, min(num_tokens, topk - start))  # queries lo < full_until keep every key
    if full_until:
        out[:full_until] = index_topk(positions.new_empty(full_until, 0).float(), positions[:full_until], topk)
        lo = full_until
    width = start + num_tokens if num_keys is None else num_keys
    while lo < num_tokens:
        hi = min(num_tokens, lo + query_chunk(width, score_bytes))
        scores = prefill_index_scores(buffer, layout, subblock_ids, dsa_layer, start + lo, q[lo:hi], weights[lo:hi],
                                      num_keys=width)
        out[lo:hi] = index_topk(scores, positions[lo:hi], topk)
        lo = hi
    return out


def sparse_mla_prefill(buffer: torch.Tensor, layout: RowLayout, subblock_ids: torch.Tensor, dsa_layer: int,
                       q_absorbed: torch.Tensor, selected: torch.Tensor, softmax_scale: float, latent_scale: float,
                       kv_lora_rank: int) -> torch.Tensor:
    """q_absorbed [T, H, kv_lora + rope], selected [T, k] int32 -> o^lat [T, H, kv_lora] fp32: the decode
    kernel with every query token as its own "request" over the one page table (row stride 0)."""
    num_tokens = q_absorbed.shape[0]
    pages = PageBatch(subblock_ids=subblock_ids.view(1, -1).expand(num_tokens, -1),
                      positions=subblock_ids.new_zeros(num_tokens), kda_row_ids=subblock_ids.new_zeros(0, 0).long(),
                      attn_row_ids=subblock_ids.new_zeros(0, 0).long(), max_len=0)
    return sparse_mla_decode(buffer, layout, pages, dsa_layer, q_absorbed, selected, softmax_scale, latent_scale,
                             kv_lora_rank, num_splits=1, block_n=PREFILL_MLA_BLOCK_N, num_warps=PREFILL_MLA_WARPS,
                             num_stages=PREFILL_MLA_STAGES)


def naive_prefill_index_scores(index_keys: torch.Tensor, index_scale: torch.Tensor, q: torch.Tensor,
                               weights: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Reference: engine.model.indexer.index_scores (float64 dots) of queries at first_pos.. over keys (uint8
    [L, D], scales [L]), masked causally with -inf. Returns [Tq, L]."""
    scores = reference_index_scores(q, weights, fp8_to_float(index_keys), index_scale)
    pos = torch.arange(first_pos, first_pos + q.shape[0]).unsqueeze(1)
    return scores.masked_fill(torch.arange(scores.shape[1]).unsqueeze(0) > pos, float("-inf"))


def naive_prefill_select(scores: torch.Tensor, first_pos: int, topk: int) -> torch.Tensor:
    """Reference selection: engine.model.indexer.select_topk (ascending ids, ties to the lower position)."""
    positions = torch.arange(first_pos, first_pos + scores.shape[0])
    return select_topk(scores.clone(), positions, topk)


def naive_sparse_mla_prefill(latent_bytes: torch.Tensor, q_absorbed: torch.Tensor, selected: torch.Tensor,
                             softmax_scale: float, latent_scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Reference: engine.model.mla.sparse_mla (fp32) over the dequantized latents (uint8 [L, C + R])."""
    latent = fp8_to_float(latent_bytes) * latent_scale
    return sparse_mla(q_absorbed.float(), latent, selected.long(), softmax_scale, kv_lora_rank)
