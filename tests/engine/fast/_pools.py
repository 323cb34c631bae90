"""Test helper: a packed row pool of a small config with random cached attention and KDA state."""

from __future__ import annotations

import torch

from engine.cache import BlockTable, RowPool
from engine.fast.pages import PageBatch, build_page_batch
from engine.layout import plan_layout
from engine.model.config import ModelConfig
from engine.model.numerics import fp8_quantize_rowwise, fp8_quantize_static
from engine.model.state import KDAState


def filled_pool(cfg: ModelConfig, lengths: list[int], seed: int = 0) -> tuple[RowPool, list[BlockTable]]:
    """A CPU RowPool holding len(lengths) requests with random FP8 attention rows (every DSA layer) of the given
    lengths and random KDA states."""
    layout = plan_layout(cfg)
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sum(layout.rows_per_request(n + 1)) for n in lengths)
    pool = RowPool(layout, cfg, rows)
    tables = [pool.allocate_request(n + 1) for n in lengths]
    for table, n in zip(tables, lengths):
        for layer in range(cfg.num_mla_layers):
            latent = fp8_quantize_static(torch.randn(n, cfg.latent_dim, generator=gen), cfg.latent_fp8_scale)
            keys, scales = fp8_quantize_rowwise(torch.randn(n, cfg.index_head_dim, generator=gen))
            pool.write_attention(table, layer, 0, latent, keys, scales)
        for i in range(cfg.num_kda_layers):
            h, d, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size - 1
            pool.write_kda(table, i, KDAState(torch.randn(h, d, d, generator=gen) * 0.1,
                                              torch.randn(w, 3 * h * d, generator=gen)))
    return pool, tables


def device_pages(pool: RowPool, tables: list[BlockTable], positions: list[int],
                 device: torch.device) -> tuple[torch.Tensor, PageBatch]:
    """The pool's buffer on `device` and the page batch of `tables` decoding at `positions`."""
    pages = build_page_batch(pool.layout, [t.attn_row_ids for t in tables], [t.kda_row_ids for t in tables],
                             positions, device)
    return pool.buffer.to(device), pages
