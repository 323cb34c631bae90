"""The engine's row pool: allocation, page addresses, FP8 attention bytes and KDA rows round-trip."""

from __future__ import annotations

import pytest
import torch

from engine.cache import BlockTable, DCPRowCache, OutOfRows, RowPool, RowSequenceCache
from engine.model.config import get_preset
from engine.model.state import KDAState, LocalSequenceCache
from engine.layout import plan_layout

CFG = get_preset("kimi-k3.1-mini")


@pytest.fixture
def pool() -> RowPool:
    return RowPool(plan_layout(CFG), CFG, 16)


def test_buffer_is_one_contiguous_tensor_with_a_stable_pointer(pool: RowPool) -> None:
    ptr = pool.buffer.data_ptr()
    assert pool.buffer.is_contiguous() and pool.buffer.dtype == torch.uint8
    assert pool.buffer.shape == (16, pool.layout.row_bytes)
    table = pool.allocate_request(3000)
    RowSequenceCache(pool, table).write_attention(0, 0, torch.ones(10, 80, dtype=torch.uint8),
                                                  torch.ones(10, 64, dtype=torch.uint8), torch.ones(10))
    assert pool.buffer.data_ptr() == ptr


def test_allocation_is_lowest_first_and_frees_back(pool: RowPool) -> None:
    table = pool.allocate_request(2500)  # 3 attention rows (B=1024) + 2 KDA groups
    assert table.attn_row_ids == [0, 1, 2] and table.kda_row_ids == [3, 4] and pool.num_free == 11
    other = pool.allocate(2)
    pool.free(table.row_ids)
    assert pool.num_free == 14 and pool.allocate(1) == [0] and other == [5, 6]
    with pytest.raises(OutOfRows):
        pool.allocate(99)
    with pytest.raises(ValueError):
        pool.free([15])


def test_reserved_rows_leave_the_capacity_and_cannot_be_freed(pool: RowPool) -> None:
    """`reserve_request` (the fast decode's graph padding rows): out of the capacity, not counted as used, never
    freed; an engine then refuses a request that needs more than the rows left."""
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams

    table = pool.reserve_request(1)  # 1 attention row + 2 KDA groups
    assert pool.num_usable == 13 and pool.num_free == 13 and pool.num_available == 13
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(table.row_ids)
    assert pool.allocate(13) == list(range(3, 16))
    engine = Engine(EngineConfig(num_rows=8))
    engine.pool.reserve_request(1)
    with pytest.raises(ValueError, match="the pool has 5"):
        engine.scheduler.add(engine._make_request("big", [1] * 8,
                                                  SamplingParams(max_tokens=4 * engine.layout.tokens_per_row)))


def test_attention_bytes_round_trip_at_page_addresses(pool: RowPool) -> None:
    gen = torch.Generator().manual_seed(0)
    table = pool.allocate_request(2100)
    cache = RowSequenceCache(pool, table)
    n = 2100
    latent = torch.randint(0, 256, (n, 80), generator=gen, dtype=torch.uint8)
    key = torch.randint(0, 256, (n, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, generator=gen)
    cache.write_attention(1, 0, latent[:1500], key[:1500], scale[:1500])
    cache.write_attention(1, 1500, latent[1500:], key[1500:], scale[1500:])
    back = cache.read_attention(1, n)
    assert torch.equal(back.latent, latent) and torch.equal(back.index_key, key)
    assert torch.equal(back.index_scale, scale)
    assert not pool.read_attention(table, 0, n).latent.any()  # the other DSA layer is untouched
    pages = pool.page_table(table, 1, n)
    flat, lay = pool.buffer.view(-1), pool.layout
    for page in (0, 15, 16, 32):  # pages 16+ live in the second row
        tok = page * lay.subblock_tokens
        lat_off, idx_off = int(pages.latent_offsets[page]), int(pages.index_offsets[page])
        assert torch.equal(flat[lat_off : lat_off + 80], latent[tok])
        assert torch.equal(flat[idx_off : idx_off + 64], key[tok])
        assert torch.equal(flat[idx_off + 64 : idx_off + 68].view(torch.float32), scale[tok : tok + 1])
        row = table.attn_row_ids[tok // lay.block_size]
        assert lat_off == row * lay.row_bytes + lay.latent_page_offset(page % lay.subblocks_per_row, 1)


def test_kda_state_round_trips_head_major(pool: RowPool) -> None:
    gen = torch.Generator().manual_seed(1)
    table = pool.allocate_request(10)
    cache = RowSequenceCache(pool, table)
    h, d, w = CFG.kda_num_heads, CFG.kda_head_dim, CFG.kda_conv_size - 1
    states = [KDAState(torch.randn(h, d, d, generator=gen), torch.randn(w, 3 * h * d, generator=gen))
              for _ in range(CFG.num_kda_layers)]
    for i, state in enumerate(states):
        cache.write_kda(i, state)
    for i, state in enumerate(states):
        back = cache.read_kda(i)
        assert torch.equal(back.recurrent, state.recurrent) and torch.equal(back.conv, state.conv)
    lay, flat = pool.layout, pool.buffer.view(-1)
    row = table.kda_row_ids[1]  # KDA layer index 4 = group 1, layer 1 of the group
    off = row * lay.row_bytes + lay.kda_recurrent_offset(2, 1)
    assert torch.equal(flat[off : off + d * d * 4].view(torch.float32).view(d, d), states[4].recurrent[2])
    conv_off = row * lay.row_bytes + lay.kda_conv_offset(2, 1)
    conv = flat[conv_off : conv_off + lay.kda_conv_bytes].view(torch.float32).view(3, d, w)
    assert torch.equal(conv[1, :, 0], states[4].conv[0, h * d + 2 * d : h * d + 3 * d])  # k channels of head 2


def test_bf16_conv_state_is_stored_rounded_and_read_back_as_fp32() -> None:
    """A config whose conv state is bf16 (K3.1's conv_state_bytes = 2): the pool stores the conv state rounded to
    bf16 at the layout's conv offsets (2 bytes a value, the fast kernels' format) and reads it back as fp32; the
    recurrent state stays fp32 bit for bit; a 3-byte conv state is refused."""
    import dataclasses

    cfg = dataclasses.replace(CFG, conv_state_bytes=2)
    pool = RowPool(plan_layout(cfg), cfg, 8)
    table = pool.allocate_request(10)
    h, d, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size - 1
    gen = torch.Generator().manual_seed(2)
    state = KDAState(torch.randn(h, d, d, generator=gen), torch.randn(w, 3 * h * d, generator=gen))
    for write, read in ((lambda s: pool.write_kda(table, 3, s), lambda: pool.read_kda(table, 3)),
                        (lambda s: pool.write_kda_batch([table], 3, KDAState(s.recurrent[None], s.conv[None])),
                         lambda: (lambda b: KDAState(b.recurrent[0], b.conv[0]))(pool.read_kda_batch([table], 3)))):
        pool.buffer[table.kda_row_ids] = 0
        write(state)
        back = read()
        assert back.conv.dtype == torch.float32 and torch.equal(back.conv, state.conv.bfloat16().float())
        assert not torch.equal(back.conv, state.conv)  # the rounding happened
        assert torch.equal(back.recurrent, state.recurrent)
    lay, flat = pool.layout, pool.buffer.view(-1)
    group, layer_in_group = divmod(3, lay.kda_layers_per_group)
    conv_off = table.kda_row_ids[group] * lay.row_bytes + lay.kda_conv_offset(2, layer_in_group)
    stored = flat[conv_off : conv_off + lay.kda_conv_bytes].view(torch.bfloat16).view(3, d, w)
    assert torch.equal(stored[0, :, 0], state.conv[0, 2 * d : 3 * d].bfloat16())  # q channels of head 2
    with pytest.raises(ValueError, match="conv_state_bytes"):
        RowPool(plan_layout(CFG), dataclasses.replace(CFG, conv_state_bytes=3), 8)


def test_fresh_rows_start_with_zero_kda_state(pool: RowPool) -> None:
    pool.buffer.fill_(7)
    table = pool.allocate_request(10)
    local = LocalSequenceCache(CFG, 10).read_kda(0)
    back = RowSequenceCache(pool, table).read_kda(0)
    assert torch.equal(back.recurrent, local.recurrent) and torch.equal(back.conv, local.conv)


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_row_cache_keeps_the_owned_tokens_where_a_transfer_lands_them(dcp: int) -> None:
    """Each DCP rank's view keeps exactly its owned tokens (layout.dcp_owner), at row dcp_local // tokens_per_row,
    whatever mix of prefill-sized and one-token writes produced them; KDA state is the rank's own."""

    cfg = get_preset("kimi-k3.1-mini")
    layout = plan_layout(cfg, tp_size=dcp, dcp_size=dcp)
    length = 3 * layout.block_size + 5
    gen = torch.Generator().manual_seed(dcp)
    n = cfg.num_mla_layers
    latent = torch.randint(0, 256, (n, length, cfg.latent_dim), dtype=torch.uint8, generator=gen)
    keys = torch.randint(0, 256, (n, length, cfg.index_head_dim), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, length, generator=gen)
    prefix = layout.block_size + 3  # a prefill of `prefix` tokens, then one token at a time
    for rank in range(dcp):
        pool = RowPool(layout, cfg, 16)
        table = pool.allocate_request(length)
        cache = DCPRowCache(pool, table, rank)
        for i in range(n):
            cache.write_attention(i, 0, latent[i, :prefix], keys[i, :prefix], scales[i, :prefix])
            for pos in range(prefix, length):
                cache.write_attention(i, pos, latent[i, pos:pos + 1], keys[i, pos:pos + 1], scales[i, pos:pos + 1])
        owned = [t for t in range(length) if layout.dcp_owner(t) == rank]
        assert [layout.dcp_local_token(t) for t in owned] == list(range(len(owned)))
        for i in range(n):
            rows = cache.read_owned(i, length)
            assert torch.equal(rows.latent, latent[i, owned]) and torch.equal(rows.index_key, keys[i, owned])
            assert torch.equal(rows.index_scale, scales[i, owned])
            shorter = cache.read_owned(i, prefix)
            assert shorter.latent.shape[0] == sum(1 for t in owned if t < prefix)
        # the row of block k holds the owned tokens of block k: what kv_transfer.remap reads into it
        t = owned[-1]
        row = table.attn_row_ids[layout.dcp_local_token(t) // layout.tokens_per_row]
        assert row == table.attn_row_ids[t // layout.block_size]
        state = KDAState(torch.randn(layout.kda_heads_per_gpu, cfg.kda_head_dim, cfg.kda_head_dim, generator=gen),
                         torch.randn(cfg.kda_conv_size - 1, 3 * layout.kda_heads_per_gpu * cfg.kda_head_dim,
                                     generator=gen))
        cache.write_kda(1, state)
        back = cache.read_kda(1)
        assert torch.equal(back.recurrent, state.recurrent) and torch.equal(back.conv, state.conv)
    with pytest.raises(ValueError, match="DCP rank"):
        DCPRowCache(RowPool(layout, cfg, 4), BlockTable(), dcp)
