"""DSA indexer for decode, fused over the packed pages: one query per request scored against every cached FP8
index key of that request, read in-kernel from the row pool, then the top-k.

`index_scores` (Triton, one program per (request, run of pages)): loads the request's query [H_I, D] (e4m3
values) and its head weights once, then walks its pages, loading each page's keys (FP8 bytes) and fp32 scales
straight from the index page (engine/fast/pages.py addressing: one sub-block id per page, the entries
contiguous), and computes
    I[b, t] = scale_t * sum_h w[b, h] * ReLU(q[b, h] . k_t)        for t <= pos[b], -inf after
with the dots on tensor cores (FP8 x FP8 on CUDA, or both widened to bf16, which is exact; the products are
exact in the fp32 accumulator; only the sum of d_I products rounds, where the reference sums in float64).
`index_topk` then takes the top-k of each row (torch.topk: one radix-select kernel) and marks unused slots -1.
Selections are returned unsorted: the sparse MLA kernel does not depend on the order. Tie-breaking at the k-th
score follows torch.topk, not the reference's lower-position rule; tests compare sets exactly away from ties.
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

@triton.jit
def _index_scores_kernel(pool8_ptr, pool32_ptr, sb_ptr, pos_ptr, q_ptr, w_ptr, out_ptr,
                         sb_stride, out_stride, num_pages, pages_per_prog, index_base, subblock_bytes,
                         H: tl.constexpr, D: tl.constexpr, B0: tl.constexpr, ENTRY: tl.constexpr,
                         ALIGN: tl.constexpr, FP8_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    first = tl.program_id(1) * pages_per_prog
    last = tl.minimum(first + pages_per_prog, num_pages)
    pos = tl.load(pos_ptr + b)
    heads = tl.arange(0, H)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + b * H * D + heads[:, None] * D + dims[None, :])  # [H, D] e4m3 values (fp8 or bf16)
    w = tl.load(w_ptr + b * H + heads)  # [H] fp32 (0 for padded heads)
    t = tl.arange(0, B0)
    key_off = t[:, None] * ENTRY + dims[None, :]  # a page's entries: [key bytes | fp32 scale] every ENTRY bytes
    scale_off = t * (ENTRY // 4) + D // 4
    row_out = out_ptr + b.to(tl.int64) * out_stride
    for page in range(first, last):
        n = page * B0 + t
        if page * B0 <= pos:
            sb = tl.load(sb_ptr + b * sb_stride + page).to(tl.int64)
            base = tl.multiple_of(sb * subblock_bytes + index_base, ALIGN)  # the page's first entry
            keys = tl.load(pool8_ptr + base + key_off)  # [B0, D]
            scale = tl.load(pool32_ptr + base // 4 + scale_off)
            if FP8_DOT:
                dots = tl.dot(q, tl.trans(keys))  # fp8 x fp8 -> fp32 on tensor cores
            else:
                dots = mm(q, tl.trans(keys.to(tl.bfloat16)), INTERPRET)  # [H, B0] fp32
            score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
            score = tl.where(n <= pos, score, float("-inf"))
        else:
            score = tl.full([B0], float("-inf"), tl.float32)
        tl.store(row_out + n, score, mask=n < out_stride)


def byte_alignment(*offsets: int) -> int:
    """The largest power of two up to 16 dividing every offset (the alignment of every page address)."""
    align = 16
    while any(o % align for o in offsets):
        align //= 2
    return align


def pad_heads(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H_I, D] (e4m3 values), weights [B, H_I] -> q and fp32 weights with heads padded to a power of two
    >= 16 (tensor-core tiles), padded heads weighted 0 (bf16 q then); a head count that needs no padding
    returns q as it is (the caller casts it once)."""
    batch, heads, dim = q.shape
    padded = max(16, triton.next_power_of_2(heads))
    if padded == heads:
        return q, weights.float()
    q_out = q.new_zeros(batch, padded, dim, dtype=torch.bfloat16)
    q_out[:, :heads] = q
    w_out = weights.new_zeros(batch, padded, dtype=torch.float32)
    w_out[:, :heads] = weights
    return q_out, w_out


def pages_per_program(total_pages: int, num_sms: int = 132, waves: int = 4) -> int:
    """Pages each program scores: enough programs for `waves` per SM, at most 32 pages (270 KB at K3.1 Pro) each."""
    return max(1, min(32, -(-total_pages // (waves * num_sms))))


def index_scores(buffer: torch.Tensor, layout: RowLayout, pages: PageBatch, dsa_layer: int, q: torch.Tensor,
                 weights: torch.Tensor, num_keys: int | None = None, fp8_dot: bool | None = None) -> torch.Tensor:
    """Scores [B, num_keys] (default pages.max_len) of each request's query against its cached keys, -inf past
    its position. q [B, H_I, D] e4m3-valued, weights [B, H_I]; `buffer` the pool [rows, row_bytes] uint8.

    One program per (request, run of pages): it loads the query once and walks its pages, one page (b0 keys,
    contiguous entries) per iteration with a single sub-block id; pages past the request's position are not
    read. `fp8_dot` (default: on CUDA) multiplies the e4m3 query and keys on the FP8 tensor cores instead of
    widening both to bf16 (the same exact products either way)."""
    num_keys = pages.max_len if num_keys is None else num_keys
    qp, wp = pad_heads(q, weights)
    batch, heads, dim = qp.shape
    entry = layout.index_bytes
    assert dim & (dim - 1) == 0 and entry % 4 == 0 and layout.subblock_bytes % 4 == 0 and entry >= dim + 4
    if fp8_dot is None:
        fp8_dot = buffer.is_cuda and not interpreter_active()
    qp = qp.to(FP8_DTYPE if fp8_dot else torch.bfloat16).contiguous()  # e4m3 values: exact either way
    wp = wp.contiguous()
    b0 = layout.subblock_tokens
    num_pages = min(pages.subblock_ids.shape[1], -(-num_keys // b0))
    out = torch.empty(batch, num_keys, dtype=torch.float32, device=buffer.device)
    per_prog = pages_per_program(batch * num_pages)
    flat = buffer.view(-1)
    grid = (batch, triton.cdiv(num_pages, per_prog))
    _index_scores_kernel[grid](
        flat.view(FP8_DTYPE), flat.view(torch.float32), pages.subblock_ids, pages.positions, qp, wp, out,
        pages.subblock_ids.stride(0), num_keys, num_pages, per_prog,
        dsa_layer * layout.layer_stride + layout.latent_page_bytes, layout.subblock_bytes,
        H=heads, D=dim, B0=b0, ENTRY=entry,
        ALIGN=byte_alignment(layout.subblock_bytes, layout.layer_stride, layout.latent_page_bytes),
        FP8_DOT=fp8_dot, INTERPRET=interpreter_active(), num_warps=4,
    )
    if num_keys > num_pages * b0:  # keys past the page table: never cached
        out[:, num_pages * b0:] = float("-inf")
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
