"""A decode batch's view of the packed row pool: per request its attention sub-block ids and KDA row ids.

Kernels address a token t of request b in DSA layer l as (engine/layout.py):
    sub-block s = subblock_ids[b, t // b0]      (global: row * subblocks_per_row + j)
    latent      = s * subblock_bytes + l * layer_stride + (t % b0) * latent_bytes
    index entry = latent page base + latent_page_bytes + (t % b0) * index_bytes  ([key bytes | fp32 scale])
so one int32 table [B, max_pages] serves every DSA layer. KDA state of request b, KDA layer i:
row `kda_row_ids[b, i // layers_per_group]`, head h at `layout.kda_recurrent_offset(h, i % layers_per_group)`.
On one rank local token = request token; on a DCP rank (dcp_size > 1) the rows hold the rank's owned tokens
in order and t is a local index (engine/parallel/fast_dcp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.layout import RowLayout


@dataclass(frozen=True)
class PageBatch:
    """Device tensors of one decode step (built once per step, shared by every layer)."""

    subblock_ids: torch.Tensor  # [B, P] int32 global sub-block ids (P = pages of the longest request)
    positions: torch.Tensor  # [B] int32: the position of the token being decoded (its keys are 0..pos)
    kda_row_ids: torch.Tensor  # [B, groups] int64 KDA rows
    attn_row_ids: torch.Tensor  # [B, R] int64 attention rows (R = rows of the longest request)
    max_len: int
    """Longest cached length in the batch, max(positions) + 1."""
    write_positions: torch.Tensor | None = None
    """[B] int32 where `write_token` stores each request's new token, -1: not stored here (a DCP rank that does
    not own it); None: at `positions`."""


def build_page_batch(layout: RowLayout, attn_rows: list[list[int]], kda_rows: list[list[int]],
                     positions: list[int], device: torch.device | str,
                     write_positions: list[int] | None = None) -> PageBatch:
    """Page table of B requests whose token positions[b] is being decoded (rows must cover it). On a DCP rank's
    pool (layout dcp_size > 1) positions are local token indices (its owned tokens in order: -1 when it owns
    none yet) and `write_positions` says where each request's new token lands on this rank (-1: elsewhere)."""
    if layout.dcp_size != 1 and write_positions is None:
        raise ValueError("a DCP rank's page batch needs write_positions (which new tokens this rank stores)")
    max_len = max(max(positions) + 1, 1)
    num_pages = -(-max_len // layout.subblock_tokens)
    num_rows = -(-num_pages // layout.subblocks_per_row)
    rows = torch.zeros(len(attn_rows), num_rows, dtype=torch.int64)
    for b, ids in enumerate(attn_rows):
        need = -(-(max(positions[b], 0 if write_positions is None else write_positions[b]) + 1)
                 // layout.tokens_per_row)
        if len(ids) < need:
            raise ValueError(f"request {b} has {len(ids)} attention rows, position {positions[b]} needs {need}")
        take = ids[:num_rows]
        rows[b, : len(take)] = torch.tensor(take, dtype=torch.int64)
    pages = torch.arange(num_pages)
    sb = rows[:, pages // layout.subblocks_per_row] * layout.subblocks_per_row + pages % layout.subblocks_per_row
    return PageBatch(
        subblock_ids=sb.to(torch.int32).to(device),
        positions=torch.tensor(positions, dtype=torch.int32).to(device),
        kda_row_ids=torch.tensor(kda_rows, dtype=torch.int64).to(device),
        attn_row_ids=rows.to(device),
        max_len=max_len,
        write_positions=(None if write_positions is None
                         else torch.tensor(write_positions, dtype=torch.int32).to(device)),
    )


def token_byte_offsets(layout: RowLayout, pages: PageBatch, dsa_layer: int, tokens: torch.Tensor,
                       index: bool) -> torch.Tensor:
    """Byte offsets in the flat pool of tokens [B, n] (request-local positions) of one DSA layer."""
    b0 = layout.subblock_tokens
    sb = pages.subblock_ids.long().gather(1, tokens // b0)
    base = sb * layout.subblock_bytes + dsa_layer * layout.layer_stride
    if index:
        return base + layout.latent_page_bytes + (tokens % b0) * layout.index_bytes
    return base + (tokens % b0) * layout.latent_bytes


@triton.jit
def _write_token_kernel(pool8_ptr, pool32_ptr, sb_ptr, pos_ptr, lat_ptr, key_ptr, scale_ptr, sb_stride,
                        layer_base, subblock_bytes, latent_bytes, index_base, index_bytes,
                        B0: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b)
    if pos < 0:  # stored by another DCP rank
        return
    sb = tl.load(sb_ptr + b * sb_stride + pos // B0).to(tl.int64)
    page = sb * subblock_bytes + layer_base
    slot = (pos % B0).to(tl.int64)
    cols = tl.arange(0, BC)
    latent = tl.load(lat_ptr + b * C + cols, mask=cols < C)
    tl.store(pool8_ptr + page + slot * latent_bytes + cols, latent, mask=cols < C)
    entry = page + index_base + slot * index_bytes
    dims = tl.arange(0, D)
    tl.store(pool8_ptr + entry + dims, tl.load(key_ptr + b * D + dims))
    tl.store(pool32_ptr + (entry + D) // 4, tl.load(scale_ptr + b))


def write_token(buffer: torch.Tensor, layout: RowLayout, pages: PageBatch, dsa_layer: int, latent: torch.Tensor,
                index_key: torch.Tensor, index_scale: torch.Tensor) -> None:
    """Store each request's new token (at pages.write_positions, else pages.positions; -1: not on this rank) in
    DSA layer `dsa_layer`: latent [B, C] uint8, index_key [B, D] uint8, index_scale [B] float32 (the bytes
    engine.cache.RowPool.write_attention_tokens writes). One Triton program per request: its latent row, then
    its index entry [key bytes | fp32 scale]."""
    batch, width = latent.shape
    dim = index_key.shape[1]
    assert dim & (dim - 1) == 0 and (layout.latent_page_bytes + dim) % 4 == 0 and layout.index_bytes % 4 == 0
    assert layout.subblock_bytes % 4 == 0 and layout.layer_stride % 4 == 0
    flat = buffer.view(-1)
    _write_token_kernel[(batch,)](
        flat, flat.view(torch.float32), pages.subblock_ids,
        pages.positions if pages.write_positions is None else pages.write_positions, latent.contiguous(),
        index_key.contiguous(), index_scale.float().contiguous(), pages.subblock_ids.stride(0),
        dsa_layer * layout.layer_stride, layout.subblock_bytes, layout.latent_bytes, layout.latent_page_bytes,
        layout.index_bytes, B0=layout.subblock_tokens, C=width, BC=triton.next_power_of_2(width), D=dim,
        num_warps=1)
