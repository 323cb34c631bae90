"""Remap planner: every byte a D rank needs is read exactly once from the right place, minimal descriptors."""

from __future__ import annotations

import random
import zlib

import pytest

from engine.layout import plan_layout
from engine.model.config import get_preset
from kv_transfer.remap import (
    IncompatiblePair,
    naive_subblock_map,
    pair_problems,
    plan_reads,
)

MINI = get_preset("kimi-k3.1-mini")
PRO = get_preset("kimi-k3.1-pro")

PAIRS = {  # id: (P kwargs, D kwargs)
    "tp1-tp1-B1024-B2048": ({"tp_size": 1}, {"tp_size": 1, "block_size": 2048}),
    "tp2-tp1": ({"tp_size": 2}, {"tp_size": 1}),
    "tp1-tp2": ({"tp_size": 1, "block_size": 2048}, {"tp_size": 2}),
    "tp2-tp4": ({"tp_size": 2}, {"tp_size": 4, "block_size": 1024}),
    "tp4-tp1": ({"tp_size": 4}, {"tp_size": 1}),
    "tp1-dcp2-u64": ({"tp_size": 1}, {"tp_size": 2, "dcp_size": 2, "dcp_interleave": 64}),
    "tp2-dcp4-u128": ({"tp_size": 2}, {"tp_size": 4, "dcp_size": 4, "block_size": 2048, "dcp_interleave": 128}),
    "tp1-dcp2-auto": ({"tp_size": 1}, {"tp_size": 2, "dcp_size": 2}),
    "tp4-dcp2-u1024": ({"tp_size": 4}, {"tp_size": 2, "dcp_size": 2, "block_size": 4096, "dcp_interleave": 1024}),
}


def _rows(n, pool, rng):
    return rng.sample(range(pool), n)


def _expand(ops, p_row_bytes, d_row_bytes, kind):
    """Byte-range map (D pool offset -> (P rank, P pool offset)) at sub-block granularity."""
    out = {}
    for op in ops:
        if op.kind != kind:
            continue
        p0, d0 = op.p_row * p_row_bytes + op.p_offset, op.d_row * d_row_bytes + op.d_offset
        out[(d0, op.length)] = (op.p_rank, p0)
    return out


@pytest.mark.parametrize("num_tokens", [4096, 3000, 65])
@pytest.mark.parametrize("case", list(PAIRS))
def test_plan_covers_every_needed_byte_once(case, num_tokens):
    pk, dk = PAIRS[case]
    p, d = plan_layout(MINI, **pk), plan_layout(MINI, **dk)
    rng = random.Random(zlib.crc32(f"{case}-{num_tokens}".encode()))
    p_attn = _rows(-(-num_tokens // p.block_size), 64, rng)
    d_attn = _rows(-(-num_tokens // d.block_size), 64, rng)
    p_kda, d_kda = _rows(p.kda_groups, 64, rng), _rows(d.kda_groups, 64, rng)
    plan = plan_reads(p, d, num_tokens, p_attn, p_kda, d_attn, d_kda)
    assert sorted(plan.reads) == list(range(d.tp_size))
    for d_rank, ops in plan.reads.items():
        # attention: expand ops into sub-blocks and compare with the token-by-token reference
        got = {}
        for op in ops:
            if op.kind != "attn":
                continue
            assert op.length % p.subblock_bytes == 0
            for k in range(op.length // p.subblock_bytes):
                d_off = op.d_row * d.row_bytes + op.d_offset + k * p.subblock_bytes
                assert d_off not in got, "a D byte range is written twice"
                got[d_off] = op.p_row * p.row_bytes + op.p_offset + k * p.subblock_bytes
        assert got == naive_subblock_map(p, d, num_tokens, d_rank, p_attn, d_attn)
        # every attention op reads from one P rank; different D ranks spread over P ranks
        # KDA: D rank's heads, each head once, from the P rank that owns it
        h0, h1 = d.global_heads(d_rank)
        heads = {}
        for op in (o for o in ops if o.kind == "kda"):
            for k in range(op.length // p.kda_head_bytes):
                ph = op.p_rank * p.kda_heads_per_gpu + op.p_offset // p.kda_head_bytes + k
                dh = h0 + op.d_offset // d.kda_head_bytes + k
                assert ph == dh
                heads[(op.d_row, dh)] = op.p_row
        assert heads == {(d_kda[g], h): p_kda[g] for g in range(d.kda_groups) for h in range(h0, h1)}


def test_descriptor_counts_are_minimal():
    p, d = plan_layout(MINI, tp_size=1), plan_layout(MINI, tp_size=2)
    plan = plan_reads(p, d, 4096, [5, 9, 1, 30], [2, 3], [7, 3, 11, 12, 13, 40, 41, 42], [0, 1])
    for ops in plan.reads.values():
        attn = [o for o in ops if o.kind == "attn"]
        # P row 5 -> D rows 7, 3 (not adjacent): 2; row 9 -> 11, 12 adjacent: 1; row 1 -> 13 | (40 not 14): 2;
        # row 30 -> 41, 42: 1 (P contiguous and D contiguous)
        assert len(attn) == 6
        assert len([o for o in ops if o.kind == "kda"]) == 2
    # consecutive rows on both sides merge into one descriptor
    plan = plan_reads(p, p, 4096, [4, 5, 6, 7], [0, 1], [10, 11, 12, 13], [2, 3])
    assert [o.length for o in plan.reads[0] if o.kind == "attn"] == [4 * p.row_bytes]


def test_reads_per_d_rank_and_spread_over_p_ranks():
    p, d = plan_layout(MINI, tp_size=2), plan_layout(MINI, tp_size=4)
    plan = plan_reads(p, d, 1024, [0, 1], [2, 3], [0, 1, 2, 3], [4, 5])
    assert [list(plan.by_source(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert plan.num_reads() == 4
    back = plan_reads(d, p, 1024, [0, 1, 2, 3], [4, 5], [0, 1], [2, 3])
    assert [sorted(back.by_source(r)) for r in range(2)] == [[0, 1], [2, 3]]


def test_pro_dcp8_descriptor_size():
    p, d = plan_layout(PRO, tp_size=8), plan_layout(PRO, tp_size=8, dcp_size=8)
    n = 32_768
    plan = plan_reads(p, d, n, list(range(16)), [100, 101, 102], [0, 1], [200, 201, 202])
    attn = [o for o in plan.reads[3] if o.kind == "attn"]
    assert len(attn) == n // 64 // 8 and {o.length for o in attn} == {64 * 16_992}


def test_incompatible_pairs_refused_with_reasons():
    p = plan_layout(MINI, tp_size=1)
    with pytest.raises(IncompatiblePair, match="fingerprints differ"):
        plan_reads(p, plan_layout(MINI, index_key_format="mxfp4"), 100, [0], [1, 2], [0], [1, 2])
    with pytest.raises(IncompatiblePair, match="prefill DCP"):
        plan_reads(plan_layout(MINI, tp_size=2, dcp_size=2), p, 100, [0], [1, 2], [0], [1, 2])

    class G:
        def __init__(self, tp, dcp, bs, fp):
            self.tp, self.dcp, self.block_size, self.layout_fingerprint = tp, dcp, bs, fp

    assert pair_problems(G(2, 1, 512, "x"), G(4, 4, 1024, "x")) == []
    reasons = pair_problems(G(3, 1, 768, "x"), G(4, 3, None, "y"))
    joined = " | ".join(reasons)
    for needle in ("fingerprints differ", "decode DCP 3", "prefill TP 3", "prefill block size 768", "decode block size unknown"):
        assert needle in joined


def test_row_lists_checked_before_planning():
    p = plan_layout(MINI)
    with pytest.raises(ValueError, match="P attention rows"):
        plan_reads(p, p, 2048, [0], [1, 2], [0, 3], [1, 2])


@pytest.mark.parametrize("case", ["tp2-tp1", "tp1-dcp2-auto"])
def test_spare_decode_rows_are_left_untouched(case):
    """D allocates rows for prompt + max_tokens: the transferred tokens land in the first rows, the spare ones
    are not read into; fewer rows than the tokens need is refused."""
    pk, dk = PAIRS[case]
    p, d = plan_layout(MINI, **pk), plan_layout(MINI, **dk)
    num_tokens = 3 * d.block_size + 1
    p_attn = list(range(-(-num_tokens // p.block_size)))
    p_kda, d_kda = list(range(60, 60 + p.kda_groups)), list(range(70, 70 + d.kda_groups))
    exact = list(range(100, 104))
    plan = plan_reads(p, d, num_tokens, p_attn, p_kda, exact, d_kda)
    assert plan_reads(p, d, num_tokens, p_attn, p_kda, exact + [104, 105], d_kda).reads == plan.reads
    with pytest.raises(ValueError, match="D attention rows: 3 given, 4 needed"):
        plan_reads(p, d, num_tokens, p_attn, p_kda, exact[:3], d_kda)
