"""Incremental P -> D plans: the blocks D's prefix cache holds are not read; everything else is, exactly as in
the full plan, and the KDA rows always are."""

from __future__ import annotations

import pytest

from engine.layout import plan_layout
from kv_transfer.remap import plan_reads
from tests.kv_transfer.test_remap import MINI, PAIRS, naive_subblock_map


def _subblocks(ops, p, d):
    got = {}
    for op in ops:
        if op.kind == "attn":
            for k in range(op.length // p.subblock_bytes):
                got[op.d_row * d.row_bytes + op.d_offset + k * p.subblock_bytes] = \
                    op.p_row * p.row_bytes + op.p_offset + k * p.subblock_bytes
    return got


@pytest.mark.parametrize("case", list(PAIRS))
@pytest.mark.parametrize("held_blocks", [1, 2])
def test_skipped_blocks_are_not_read_and_the_rest_is(case, held_blocks):
    pk, dk = PAIRS[case]
    p, d = plan_layout(MINI, **pk), plan_layout(MINI, **dk)
    num_tokens = 2 * d.block_size + 100
    skip = held_blocks * d.block_size
    p_attn = list(range(-(-num_tokens // p.block_size)))
    d_attn = list(range(200, 200 + -(-num_tokens // d.block_size)))
    p_kda, d_kda = list(range(60, 60 + p.kda_groups)), list(range(70, 70 + d.kda_groups))
    full = plan_reads(p, d, num_tokens, p_attn, p_kda, d_attn, d_kda)
    part = plan_reads(p, d, num_tokens, p_attn, p_kda, d_attn, d_kda, skip_tokens=skip)
    assert part.consumers() == full.consumers()  # P still hears one DONE per READ it expects
    held_rows = set(d_attn[:held_blocks])
    for d_rank in full.reads:
        want = {off: src for off, src in naive_subblock_map(p, d, num_tokens, d_rank, p_attn, d_attn).items()
                if off // d.row_bytes not in held_rows}
        assert _subblocks(part.reads[d_rank], p, d) == want
        kda = lambda ops: [(o.p_rank, o.p_row, o.p_offset, o.length, o.d_row, o.d_offset)  # noqa: E731
                           for o in ops if o.kind == "kda"]
        assert kda(part.reads[d_rank]) == kda(full.reads[d_rank])


def test_skip_must_be_whole_decode_blocks():
    p = d = plan_layout(MINI)
    with pytest.raises(ValueError, match="whole D blocks"):
        plan_reads(p, d, 3000, [0, 1, 2], [5, 6], [0, 1, 2], [5, 6], skip_tokens=100)
