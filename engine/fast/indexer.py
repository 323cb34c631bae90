"""DSA indexer for decode, fused over the packed pages: one query per request scored against every cached FP8
index key of that request, read in-kernel from the row pool, then the top-k.

`index_scores` (Triton, one program per (request, block of BLOCK_N keys)): loads the request's query [H_I, D]
(bf16 holding e4m3 values: exact) and its head weights once, the keys' FP8 bytes and fp32 scales straight from
the index pages (engine/fast/pages.py addressing), and computes
    I[b, t] = scale_t * sum_h w[b, h] * ReLU(q[b, h] . k_t)        for t <= pos[b], -inf after
with the dots on tensor cores (e4m3 -> bf16 is exact, products are exact in the fp32 accumulator; only the sum
of d_I products rounds, where the reference sums in float64). `index_topk` then takes the top-k of each row
(torch.topk: one radix-select kernel) and marks unused slots -1. Selections are returned unsorted: the sparse
MLA kernel does not depend on the order. Tie-breaking at the k-th score follows torch.topk, not the reference's
lower-position rule; tests compare sets exactly away from ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active
from engine.fast.dot import mm
from engine.fast.pages import PageBatch
from engine.layout import RowLayout
from engine.model.indexer import index_scores as reference_index_scores
from engine.model.indexer import select_topk
from engine.model.numerics import FP8_DTYPE, fp8_to_float

BLOCK_N = 128


@triton.jit
def _index_scores_kernel(pool8_ptr, pool32_ptr, sb_ptr, pos_ptr, q_ptr, w_ptr, out_ptr,
                         sb_stride, out_stride, index_base, subblock_bytes, index_bytes,
                         H: tl.constexpr, D: tl.constexpr, B0: tl.constexpr, BLOCK: tl.constexpr,
                         ALIGN: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    n = blk * BLOCK + tl.arange(0, BLOCK)
    valid = n <= pos
    sb = tl.load(sb_ptr + b * sb_stride + n // B0, mask=valid, other=0).to(tl.int64)
    base = sb * subblock_bytes + index_base + (n % B0).to(tl.int64) * index_bytes  # [BLOCK] byte offsets
    base = tl.multiple_of(base, ALIGN)  # lets the compiler load ALIGN bytes at a time
    dims = tl.arange(0, D)
    keys = tl.load(pool8_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    scale = tl.load(pool32_ptr + (base + D) // 4, mask=valid, other=0.0)
    heads = tl.arange(0, H)
    q = tl.load(q_ptr + b * H * D + heads[:, None] * D + dims[None, :])  # [H, D] bf16
    w = tl.load(w_ptr + b * H + heads)  # [H] fp32 (0 for padded heads)
    dots = mm(q, tl.trans(keys.to(tl.bfloat16)), INTERPRET)  # [H, BLOCK] fp32
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + b * out_stride + n, score, mask=n < out_stride)


def byte_alignment(*offsets: int) -> int:
    """The largest power of two up to 16 dividing every offset (the alignment of every page address)."""
    align = 16
    while any(o % align for o in offsets):
        align //= 2
    return align


def pad_heads(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H_I, D] (e4m3 values), weights [B, H_I] -> bf16 q and fp32 weights with heads padded to >= 16
    (tensor-core tiles), padded heads weighted 0."""
    batch, heads, dim = q.shape
    padded = max(16, triton.next_power_of_2(heads))
    q_out = q.new_zeros(batch, padded, dim, dtype=torch.bfloat16)
    q_out[:, :heads] = q
    w_out = weights.new_zeros(batch, padded, dtype=torch.float32)
    w_out[:, :heads] = weights
    return q_out, w_out


def index_scores(buffer: torch.Tensor, layout: RowLayout, pages: PageBatch, dsa_layer: int, q: torch.Tensor,
                 weights: torch.Tensor, num_keys: int | None = None) -> torch.Tensor:
    """Scores [B, num_keys] (default pages.max_len) of each request's query against its cached keys, -inf past
    its position. q [B, H_I, D] e4m3-valued, weights [B, H_I]; `buffer` the pool [rows, row_bytes] uint8."""
    num_keys = pages.max_len if num_keys is None else num_keys
    qp, wp = pad_heads(q, weights)
    batch, heads, dim = qp.shape
    assert dim & (dim - 1) == 0 and layout.index_bytes % 4 == 0 and layout.subblock_bytes % 4 == 0
    out = torch.empty(batch, num_keys, dtype=torch.float32, device=buffer.device)
    flat = buffer.view(-1)
    grid = (batch, triton.cdiv(num_keys, BLOCK_N))
    _index_scores_kernel[grid](
        flat.view(FP8_DTYPE), flat.view(torch.float32), pages.subblock_ids, pages.positions, qp, wp, out,
        pages.subblock_ids.stride(0), num_keys, dsa_layer * layout.layer_stride + layout.latent_page_bytes,
        layout.subblock_bytes, layout.index_bytes, H=heads, D=dim, B0=layout.subblock_tokens, BLOCK=BLOCK_N,
        ALIGN=byte_alignment(layout.subblock_bytes, layout.layer_stride, layout.latent_page_bytes,
                             layout.index_bytes),
        INTERPRET=interpreter_active(), num_warps=4,
    )
    return out


def index_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k key positions per row of scores [B, L] (-inf = not a key) -> [B, k] int32, -1 for unused slots."""
    batch, num_keys = scores.shape
    if num_keys <= topk:  # every cached key is kept: no selection needed
        slots = torch.arange(topk, device=scores.device, dtype=torch.int32).expand(batch, topk)
        return torch.where(slots <= positions.unsqueeze(1), slots, -1)
    values, ids = torch.topk(scores, topk, dim=-1, sorted=False)
    return torch.where(values > float("-inf"), ids.to(torch.int32), -1)


def select(buffer: torch.Tensor, layout: RowLayout, pages: PageBatch, dsa_layer: int, q: torch.Tensor,
           weights: torch.Tensor, topk: int) -> torch.Tensor:
    """The indexer of one decode step: [B, k] int32 selected positions (unsorted, -1 padded)."""
    if pages.max_len <= topk:
        slots = torch.arange(topk, device=buffer.device, dtype=torch.int32).expand(q.shape[0], topk)
        return torch.where(slots <= pages.positions.unsqueeze(1), slots, -1)
    return index_topk(index_scores(buffer, layout, pages, dsa_layer, q, weights), pages.positions, topk)


def naive_index_scores(index_keys: torch.Tensor, index_scale: torch.Tensor, q: torch.Tensor,
                       weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Reference: engine.model.indexer.index_scores per request over its keys 0..pos (uint8 keys [B, L, D],
    scales [B, L]), -inf past pos. Returns [B, L]."""
    batch, length = index_scale.shape
    out = torch.full((batch, length), float("-inf"))
    for b in range(batch):
        n = int(positions[b]) + 1
        keys = fp8_to_float(index_keys[b, :n])
        out[b, :n] = reference_index_scores(q[b : b + 1], weights[b : b + 1], keys, index_scale[b, :n])[0]
    return out


def naive_select(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Reference selection: engine.model.indexer.select_topk (ascending ids, ties to the lower position)."""
    return select_topk(scores.clone(), positions.long(), topk)
