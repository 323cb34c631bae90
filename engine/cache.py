"""The packed row pool the engine reads and writes, built on engine.layout.

One contiguous CPU or VRAM (`device`) uint8 tensor `buffer` [num_rows, row_bytes] (stable data_ptr: the NIXL transport registers it
once; remote writers/readers move whole rows or sub-block ranges of it). A row holds either one attention block
of a request (sub-block-major pages of every DSA layer, see engine/layout.py) or one KDA group's state of one
request (head-major). Rows of both kinds come from one free list.

- Bookkeeping (engine/rows.py `RowBook`, which `RowPool` extends with the bytes): `allocate(n)` / `free(ids)` /
  `num_free`, lowest ids first (SPMD lockstep); eviction of unreferenced prefix-cache blocks when free rows run
  out; quarantine (`quarantine(ids, until, key)`, `reclaim(now)`, `hold(key)`: rows a remote READ may still
  target, neither free nor allocated); `reserve_request`. It imports no torch (the scheduler and the simulator
  use it alone).
- `BlockTable`: a request's attention row ids (block k holds request tokens [k*B, (k+1)*B), or under DCP this
  rank's owned tokens of that block) and its KDA row ids (one per KDA group).
- Page-address translation (`page_table`): the fixed-size kernel pages of a request for one DSA layer, as byte
  offsets into `buffer` (`PageTable`). `RowSequenceCache` uses it to implement engine.model.state.SequenceCache,
  so attention reads exactly the FP8 bytes a transfer moves.
- `DCPRowCache`: one DCP rank's view of a request's rows (pool planned with dcp_size = W): keeps the rank's owned
  tokens of every block in the row a transfer lands them in; engine/parallel/dcp_decode.py reads it.
Cached formats: FP8 latent (per-tensor static scale, kv_lora + rope bytes), FP8 index key + fp32 scale per token
(the scale follows the key bytes inside the token's index entry), fp32 KDA recurrent [d_k, d_v] and fp32 conv
[3, d, W-1] per head and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layout import RowLayout
from engine.model.config import ModelConfig
from engine.model.state import CachedAttention, KDAState
from engine.parallel.dcp_layout import DCPLayout
from engine.rows import BlockTable, OutOfRows, RowBook

__all__ = ["BlockTable", "DCPRowCache", "OutOfRows", "PageTable", "RowPool", "RowSequenceCache"]


@dataclass(frozen=True)
class PageTable:
    """Kernel pages of one request and DSA layer: page p holds local tokens [p*b0, (p+1)*b0)."""

    latent_offsets: torch.Tensor  # [P] int64 byte offsets of latent pages in the flat buffer
    index_offsets: torch.Tensor  # [P] int64 byte offsets of index-key pages
    page_tokens: int


class RowPool(RowBook):
    """The rows' bytes, `buffer`, over engine/rows.py's bookkeeping (allocation, quarantine, reserve, eviction)."""

    def __init__(self, layout: RowLayout, cfg: ModelConfig, num_rows: int, device: str | torch.device = "cpu") -> None:
        if (cfg.latent_dtype, cfg.index_key_dtype) != (layout.latent_format, layout.index_key_format) or \
                cfg.latent_dtype not in ("fp8", "fp32") or cfg.index_key_dtype not in ("fp8", "fp32"):
            raise ValueError("the reference engine computes with fp8 or fp32 latents and index keys, as the model "
                             f"config says; got latent {cfg.latent_dtype} / index key {cfg.index_key_dtype}, layout "
                             f"{layout.latent_format} / {layout.index_key_format}")
        if cfg.ssm_state_bytes != 4 or cfg.conv_state_bytes not in (2, 4):
            raise ValueError("the row pool keeps the KDA recurrent state in fp32 (ssm_state_bytes = 4) and the conv "
                             "state in fp32 or bf16 (conv_state_bytes = 4 or 2)")
        self.conv_dtype = torch.float32 if cfg.conv_state_bytes == 4 else torch.bfloat16
        """The stored conv state's dtype: read back as fp32, written rounded to it (K3.1 keeps it in bf16)."""
        super().__init__(layout, cfg, num_rows)
        self.buffer = torch.zeros(num_rows, layout.row_bytes, dtype=torch.uint8, device=device)
        self._flat = self.buffer.view(-1)

    # ---- page-address translation ----
    def page_table(self, table: BlockTable, dsa_layer: int, num_local_tokens: int) -> PageTable:
        lay = self.layout
        num_pages = -(-num_local_tokens // lay.subblock_tokens)
        pages = torch.arange(num_pages)
        rows = torch.tensor(table.attn_row_ids, dtype=torch.int64)[pages // lay.subblocks_per_row]
        base = rows * lay.row_bytes + (pages % lay.subblocks_per_row) * lay.subblock_bytes
        latent = base + dsa_layer * lay.layer_stride
        return PageTable(latent, latent + lay.latent_page_bytes, lay.subblock_tokens)

    def _token_slots(self, table: BlockTable, local_start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(global sub-block id, token-in-page) of local tokens [local_start, local_start + count)."""
        lay = self.layout
        local = torch.arange(local_start, local_start + count)
        rows = torch.tensor(table.attn_row_ids, dtype=torch.int64)[local // lay.tokens_per_row]
        in_row = local % lay.tokens_per_row
        return rows * lay.subblocks_per_row + in_row // lay.subblock_tokens, in_row % lay.subblock_tokens

    def _pages(self, dsa_layer: int, index: bool) -> torch.Tensor:
        """Strided view [num_sub_blocks, b0, bytes_per_token] of one page kind of one layer over the pool."""
        lay = self.layout
        per_token = lay.index_bytes if index else lay.latent_bytes
        offset = dsa_layer * lay.layer_stride + (lay.latent_page_bytes if index else 0)
        num_sb = self.num_rows * lay.subblocks_per_row
        return self._flat.as_strided((num_sb, lay.subblock_tokens, per_token), (lay.subblock_bytes, per_token, 1),
                                     offset)

    # ---- attention bytes ----
    def write_attention(
        self, table: BlockTable, dsa_layer: int, local_start: int, latent: torch.Tensor, index_key: torch.Tensor,
        index_scale: torch.Tensor,
    ) -> None:
        count = latent.shape[0]
        sb, tok = self._token_slots(table, local_start, count)
        self._pages(dsa_layer, index=False)[sb, tok] = latent
        entry = torch.cat([index_key, index_scale.contiguous().view(torch.uint8).view(count, 4)], dim=1)
        self._pages(dsa_layer, index=True)[sb, tok] = entry

    def read_attention(self, table: BlockTable, dsa_layer: int, num_local_tokens: int) -> CachedAttention:
        lay = self.layout
        num_pages = -(-num_local_tokens // lay.subblock_tokens)
        pages = torch.arange(num_pages)
        sb = torch.tensor(table.attn_row_ids, dtype=torch.int64)[pages // lay.subblocks_per_row]
        sb = sb * lay.subblocks_per_row + pages % lay.subblocks_per_row
        latent = self._pages(dsa_layer, index=False)[sb].reshape(-1, lay.latent_bytes)[:num_local_tokens]
        entry = self._pages(dsa_layer, index=True)[sb].reshape(-1, lay.index_bytes)[:num_local_tokens]
        key_dim = self.cfg.index_key_value_bytes
        scale = entry[:, key_dim : key_dim + 4].contiguous().view(torch.float32).view(-1)
        return CachedAttention(latent, entry[:, :key_dim], scale)

    def write_attention_tokens(self, tables: list[BlockTable], dsa_layer: int, positions: list[int],
                               latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor) -> None:
        """One token per request (decode): latent [B, C] etc. at local positions[b] of tables[b]."""
        lay = self.layout
        pos = torch.tensor(positions, dtype=torch.int64)
        rows = torch.tensor([t.attn_row_ids[p // lay.tokens_per_row] for t, p in zip(tables, positions)])
        in_row = pos % lay.tokens_per_row
        sb, tok = rows * lay.subblocks_per_row + in_row // lay.subblock_tokens, in_row % lay.subblock_tokens
        self._pages(dsa_layer, index=False)[sb, tok] = latent
        entry = torch.cat([index_key, index_scale.contiguous().view(torch.uint8).view(-1, 4)], dim=1)
        self._pages(dsa_layer, index=True)[sb, tok] = entry

    def read_attention_padded(self, tables: list[BlockTable], dsa_layer: int, lengths: list[int]) -> CachedAttention:
        """Several requests at once, padded to the longest (padding rows hold arbitrary bytes)."""
        lay = self.layout
        num_pages = -(-max(lengths) // lay.subblock_tokens)
        pages = torch.arange(num_pages)
        row_index = pages // lay.subblocks_per_row
        sb = []
        for table in tables:
            ids = torch.tensor(table.attn_row_ids, dtype=torch.int64)
            sb.append(ids[row_index.clamp_max(len(table.attn_row_ids) - 1)] * lay.subblocks_per_row
                      + pages % lay.subblocks_per_row)
        sb_all = torch.stack(sb)  # [B, P]
        batch = len(tables)
        latent = self._pages(dsa_layer, index=False)[sb_all].reshape(batch, -1, lay.latent_bytes)
        entry = self._pages(dsa_layer, index=True)[sb_all].reshape(batch, -1, lay.index_bytes)
        key_dim = self.cfg.index_key_value_bytes
        scale = entry[..., key_dim : key_dim + 4].contiguous().view(torch.float32).view(batch, -1)
        return CachedAttention(latent, entry[..., :key_dim], scale)

    # ---- KDA state ----
    def _kda_view(self, row: int, layer_in_group: int, conv: bool) -> torch.Tensor:
        lay = self.layout
        offset = row * lay.row_bytes + (lay.kda_conv_offset(0, layer_in_group) if conv
                                         else lay.kda_recurrent_offset(0, layer_in_group))
        size = lay.kda_conv_bytes if conv else lay.kda_recurrent_bytes
        return self._flat.as_strided((lay.kda_heads_per_gpu, size), (lay.kda_head_bytes, 1), offset)

    def _kda_slot(self, table: BlockTable, kda_index: int) -> tuple[int, int]:
        group, layer_in_group = divmod(kda_index, self.layout.kda_layers_per_group)
        return table.kda_row_ids[group], layer_in_group

    def read_kda_batch(self, tables: list[BlockTable], kda_index: int) -> KDAState:
        """States of several requests: recurrent [B, H, d, d], conv [B, W-1, 3*H*d]."""
        group, li = divmod(kda_index, self.layout.kda_layers_per_group)
        rows = torch.tensor([t.kda_row_ids[group] for t in tables], dtype=torch.int64)
        h, d, w = self.layout.kda_heads_per_gpu, self.cfg.kda_head_dim, self.cfg.kda_conv_size - 1
        batch = len(tables)
        rec = self._kda_rows(li, conv=False)[rows].view(torch.float32).view(batch, h, d, d)
        conv = self._kda_rows(li, conv=True)[rows].view(self.conv_dtype).float().view(batch, h, 3, d, w)
        return KDAState(rec, conv.permute(0, 4, 2, 1, 3).reshape(batch, w, 3 * h * d))

    def write_kda_batch(self, tables: list[BlockTable], kda_index: int, state: KDAState) -> None:
        group, li = divmod(kda_index, self.layout.kda_layers_per_group)
        rows = torch.tensor([t.kda_row_ids[group] for t in tables], dtype=torch.int64)
        h, d, w = self.layout.kda_heads_per_gpu, self.cfg.kda_head_dim, self.cfg.kda_conv_size - 1
        batch = len(tables)
        rec = state.recurrent.contiguous().view(torch.uint8).view(batch, h, -1)
        conv = state.conv.view(batch, w, 3, h, d).permute(0, 3, 2, 4, 1).to(self.conv_dtype).contiguous()
        conv = conv.view(torch.uint8)
        self._kda_rows(li, conv=False)[rows] = rec
        self._kda_rows(li, conv=True)[rows] = conv.view(batch, h, -1)

    def _kda_rows(self, layer_in_group: int, conv: bool) -> torch.Tensor:
        """Strided view [num_rows, heads, bytes] of one KDA layer's recurrent (or conv) state in every row."""
        lay = self.layout
        offset = lay.kda_conv_offset(0, layer_in_group) if conv else lay.kda_recurrent_offset(0, layer_in_group)
        size = lay.kda_conv_bytes if conv else lay.kda_recurrent_bytes
        return self._flat.as_strided((self.num_rows, lay.kda_heads_per_gpu, size),
                                     (lay.row_bytes, lay.kda_head_bytes, 1), offset)

    def read_kda(self, table: BlockTable, kda_index: int) -> KDAState:
        row, li = self._kda_slot(table, kda_index)
        h, d, w = self.layout.kda_heads_per_gpu, self.cfg.kda_head_dim, self.cfg.kda_conv_size - 1
        recurrent = self._kda_view(row, li, conv=False).contiguous().view(torch.float32).view(h, d, d)
        conv = self._kda_view(row, li, conv=True).contiguous().view(self.conv_dtype).float().view(h, 3, d, w)
        return KDAState(recurrent, conv.permute(3, 1, 0, 2).reshape(w, 3 * h * d))

    def write_kda(self, table: BlockTable, kda_index: int, state: KDAState) -> None:
        row, li = self._kda_slot(table, kda_index)
        h, d, w = self.layout.kda_heads_per_gpu, self.cfg.kda_head_dim, self.cfg.kda_conv_size - 1
        rec = state.recurrent.contiguous().view(torch.uint8).view(h, -1)
        conv = state.conv.view(w, 3, h, d).permute(2, 1, 3, 0).to(self.conv_dtype).contiguous()
        conv = conv.view(torch.uint8).view(h, -1)
        self._kda_view(row, li, conv=False).copy_(rec)
        self._kda_view(row, li, conv=True).copy_(conv)


class RowSequenceCache:
    """engine.model.state.SequenceCache over one request's rows of a RowPool (single rank, no DCP)."""

    def __init__(self, pool: RowPool, table: BlockTable) -> None:
        if pool.layout.dcp_size != 1:
            raise ValueError("RowSequenceCache serves dcp_size 1; DCP ranks address their own tokens")
        self.pool = pool
        self.table = table

    def write_attention(
        self, mla_index: int, start: int, latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor
    ) -> None:
        self.pool.write_attention(self.table, mla_index, start, latent, index_key, index_scale)

    def read_attention(self, mla_index: int, length: int) -> CachedAttention:
        return self.pool.read_attention(self.table, mla_index, length)

    def read_kda(self, kda_index: int) -> KDAState:
        return self.pool.read_kda(self.table, kda_index)

    def write_kda(self, kda_index: int, state: KDAState) -> None:
        self.pool.write_kda(self.table, kda_index, state)

    # batched forms (engine.model.state.*_many use them when a whole batch shares one pool)
    @staticmethod
    def _pool_of(caches: list["RowSequenceCache"]) -> RowPool:
        pool = caches[0].pool
        assert all(c.pool is pool for c in caches), "a decode batch must share one pool"
        return pool

    @staticmethod
    def read_attention_many(caches: list["RowSequenceCache"], mla_index: int, lengths: list[int]) -> CachedAttention:
        return RowSequenceCache._pool_of(caches).read_attention_padded([c.table for c in caches], mla_index, lengths)

    @staticmethod
    def write_attention_many(caches: list["RowSequenceCache"], mla_index: int, positions: list[int],
                             latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor) -> None:
        RowSequenceCache._pool_of(caches).write_attention_tokens([c.table for c in caches], mla_index, positions,
                                                                 latent, index_key, index_scale)

    @staticmethod
    def read_kda_many(caches: list["RowSequenceCache"], kda_index: int) -> KDAState:
        return RowSequenceCache._pool_of(caches).read_kda_batch([c.table for c in caches], kda_index)

    @staticmethod
    def write_kda_many(caches: list["RowSequenceCache"], kda_index: int, state: KDAState) -> None:
        RowSequenceCache._pool_of(caches).write_kda_batch([c.table for c in caches], kda_index, state)


class DCPRowCache:
    """One request's cache on one DCP rank, over that rank's rows of a RowPool planned with dcp_size = W.

    Row k of the request holds the rank's owned tokens of block k in increasing order (engine/layout.py,
    `dcp_owner`/`dcp_local_token`), which is exactly where a transfer from a prefill row lands them. Writers
    pass full rows for global positions start..start+T-1 (a local prefill, one decode token) and the rank keeps
    its share; the owned tokens of a contiguous global range are one contiguous local range. `read_owned` is
    what engine/parallel/dcp_decode.py scores and attends over. KDA rows hold this rank's heads (tp_size = W).
    """

    def __init__(self, pool: RowPool, table: BlockTable, rank: int) -> None:
        lay = pool.layout
        if lay.dcp_size < 2:
            raise ValueError("DCPRowCache needs a pool planned with dcp_size > 1")
        if not 0 <= rank < lay.dcp_size:
            raise ValueError(f"DCP rank {rank} outside 0..{lay.dcp_size - 1}")
        self.pool, self.table, self.rank = pool, table, rank
        self.layout = DCPLayout(lay.dcp_size, lay.dcp_interleave)

    def write_attention(self, mla_index: int, start: int, latent: torch.Tensor, index_key: torch.Tensor,
                        index_scale: torch.Tensor) -> None:
        positions = torch.arange(start, start + latent.shape[0])
        mine = self.layout.owner(positions) == self.rank
        if bool(mine.any()):
            local_start = self.layout.num_local(self.rank, start)
            self.pool.write_attention(self.table, mla_index, local_start, latent[mine], index_key[mine],
                                      index_scale[mine])

    def read_owned(self, mla_index: int, length: int) -> CachedAttention:
        """Owned rows among global positions 0..length-1, in local (= global) order."""
        return self.pool.read_attention(self.table, mla_index, self.layout.num_local(self.rank, length))

    def read_kda(self, kda_index: int) -> KDAState:
        return self.pool.read_kda(self.table, kda_index)

    def write_kda(self, kda_index: int, state: KDAState) -> None:
        self.pool.write_kda(self.table, kda_index, state)
