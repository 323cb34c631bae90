"""Layout planner: SPEC.md per-token figures, block sizes, sub-block contiguity, KDA head-major rows."""

from __future__ import annotations

import pytest

from engine.model.config import get_preset
from engine.layout import plan_layout

PRO = get_preset("kimi-k3.1-pro")
MINI = get_preset("kimi-k3.1-mini")


@pytest.mark.parametrize("latent,key,expected", [
    ("fp8", "fp8", 16_992), ("nvfp4", "fp8", 11_616), ("nvfp4", "mxfp4", 10_080), ("fp8", "mxfp4", 15_456),
])
def test_pro_bytes_per_token_per_gpu(latent, key, expected):
    for tp in (1, 4, 8):
        lay = plan_layout(PRO, tp_size=tp, latent_format=latent, index_key_format=key)
        assert lay.bytes_per_token_per_gpu == expected  # replicated under TP
    dcp = plan_layout(PRO, tp_size=8, dcp_size=8, latent_format=latent, index_key_format=key)
    assert dcp.bytes_per_token_per_gpu == expected / 8


def test_pro_latent_only_is_k3_figure():
    assert plan_layout(PRO, tp_size=8).latent_only_bytes_per_token == 13_824
    assert plan_layout(PRO, latent_format="nvfp4").latent_bytes == 352
    assert plan_layout(PRO, index_key_format="mxfp4").index_bytes == 68


@pytest.mark.parametrize("tp,dcp,block,row", [(8, 1, 2048, 34_799_616), (4, 1, 4096, 69_599_232), (8, 8, 16_384, 34_799_616)])
def test_pro_block_sizes_match_layout_md(tp, dcp, block, row):
    lay = plan_layout(PRO, tp_size=tp, dcp_size=dcp)
    assert (lay.block_size, lay.row_bytes) == (block, row)
    assert lay.kda_state_bytes == 23 * (96 // tp) * (128 * 128 * 4 + 3 * 128 * 3 * 2)
    assert lay.kda_state_bytes <= lay.row_bytes < 2 * lay.kda_state_bytes or lay.tokens_per_row == lay.subblock_tokens


@pytest.mark.parametrize("tp,dcp,block", [(1, 1, 1024), (2, 1, 512), (4, 1, 256), (2, 2, 1024), (4, 4, 1024)])
def test_mini_block_sizes(tp, dcp, block):
    lay = plan_layout(MINI, tp_size=tp, dcp_size=dcp)
    assert lay.attn_bytes_per_token == 2 * (80 + 68) == 296
    assert lay.block_size == block
    assert lay.kda_state_bytes <= lay.row_bytes


@pytest.mark.parametrize("preset,tp", [(MINI, 1), (MINI, 4), (PRO, 8), (PRO, 2)])
def test_subblock_runs_are_contiguous_and_pages_tile_the_row(preset, tp):
    lay = plan_layout(preset, tp_size=tp)
    n = lay.subblocks_per_row
    # every aligned power-of-two run of sub-blocks is one range that starts where the previous ends
    size = 1
    while size <= n:
        ranges = [lay.subblock_range(j, size) for j in range(0, n, size)]
        assert ranges[0][0] == 0 and all(o == i * size * lay.subblock_bytes for i, (o, _) in enumerate(ranges))
        assert sum(length for _, length in ranges) == lay.row_bytes
        size *= 2
    # pages of every (sub-block, layer) tile the row without overlap, each of the fixed kernel size
    spans = sorted((off, size) for pair in lay.page_offsets() for off, size in
                   zip(pair_offsets(pair), (lay.latent_page_bytes, lay.index_page_bytes) * lay.num_dsa_layers))
    pos = 0
    for off, size in spans:
        assert off == pos
        pos += size
    assert pos == lay.row_bytes


def pair_offsets(layer_pairs):
    return [o for pair in layer_pairs for o in pair]


def test_kda_head_slices_contiguous_and_fit():
    for tp in (1, 2, 4):
        lay = plan_layout(MINI, tp_size=tp)
        assert lay.kda_head_slice(0, lay.kda_heads_per_gpu) == (0, lay.kda_state_bytes)
        assert lay.kda_state_bytes <= lay.row_bytes
        last = lay.kda_conv_offset(lay.kda_heads_per_gpu - 1, lay.kda_layers_per_group - 1)
        assert last + lay.kda_conv_bytes == lay.kda_state_bytes
        # a TP slice of heads on a finer instance is a contiguous slice of a coarser instance's row
        fine = plan_layout(MINI, tp_size=tp * 2) if tp < 4 else lay
        assert fine.kda_head_bytes == lay.kda_head_bytes


def test_dcp_ownership_by_aligned_units():
    lay = plan_layout(MINI, tp_size=2, dcp_size=2, dcp_interleave=64)
    owners = [lay.dcp_owner(t) for t in range(0, 512, 64)]
    assert owners == [0, 1] * 4
    assert [lay.dcp_local_token(t) for t in (0, 64, 128, 192, 130)] == [0, 0, 64, 64, 66]
    auto = plan_layout(PRO, tp_size=8, dcp_size=8)
    assert auto.dcp_interleave == 64 and auto.subblock_bytes >= 256 * 1024


def test_fingerprint_tracks_formats_not_parallelism():
    base = plan_layout(MINI, tp_size=1)
    assert base.fingerprint == plan_layout(MINI, tp_size=4, block_size=2048).fingerprint
    assert base.fingerprint == plan_layout(MINI, tp_size=2, dcp_size=2).fingerprint
    assert base.fingerprint != plan_layout(MINI, index_key_format="mxfp4").fingerprint
    assert base.fingerprint != plan_layout(MINI, subblock_tokens=32).fingerprint
    assert base.fingerprint != plan_layout(PRO).fingerprint


@pytest.mark.parametrize("kwargs,match", [
    ({"tp_size": 3}, "divide"), ({"dcp_size": 2, "tp_size": 1}, "dcp_size"), ({"block_size": 1000}, "power of two"),
    ({"block_size": 256}, ">="), ({"latent_format": "int4"}, "latent format"), ({"index_key_format": "fp4"}, "index-key"),
    ({"subblock_tokens": 48}, "power of two"),
])
def test_bad_layout_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(MINI, **kwargs)
