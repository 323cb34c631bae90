"""The P x D pairing matrix as a pure function (table-driven)."""

from __future__ import annotations

import pytest

from router.compat import Geometry, compat_matrix, move_matrix, pair_verdict


def geo(name="x", engine="vllm", model="m", tp=1, dcp=1, block_size=16, cache_dtype="auto", fp=None,
        weights="w") -> Geometry:
    return Geometry(name=name, engine=engine, model=model, tp=tp, dcp=dcp, block_size=block_size,
                    cache_dtype=cache_dtype, layout_fingerprint=fp, weights=weights)


# (id, prefill kwargs, decode kwargs, expected reason fragment or None for compatible)
CASES = [
    ("same-geometry", {}, {}, None),
    ("tp-fan-out-1-to-4", {"tp": 1}, {"tp": 4}, None),
    ("tp-fan-in-4-to-2", {"tp": 4}, {"tp": 2}, None),
    ("tp-2-to-3", {"tp": 2}, {"tp": 3}, "do not divide"),
    ("tp-4-to-6", {"tp": 4}, {"tp": 6}, "do not divide"),
    ("block-16-to-32", {"block_size": 16}, {"block_size": 32}, None),
    ("block-32-to-16", {"block_size": 32}, {"block_size": 16}, "not a multiple"),
    ("block-16-to-24", {"block_size": 16}, {"block_size": 24}, "not a multiple"),
    ("fan-in-needs-equal-blocks", {"tp": 2, "block_size": 16}, {"tp": 1, "block_size": 32}, "equal block sizes"),
    ("fan-in-equal-blocks", {"tp": 2, "block_size": 32}, {"tp": 1, "block_size": 32}, None),
    ("dcp-decode-4-of-tp-4", {"tp": 4}, {"tp": 4, "dcp": 4}, None),
    ("dcp-not-dividing-tp", {}, {"tp": 4, "dcp": 3}, "does not divide TP"),
    ("dcp-2-vs-dcp-3", {"tp": 6, "dcp": 2}, {"tp": 6, "dcp": 3}, "DCP sizes"),
    ("model-differs", {"model": "a"}, {"model": "b"}, "models differ"),
    ("kv-dtype-differs", {"cache_dtype": "fp8"}, {"cache_dtype": "auto"}, "KV cache dtypes differ"),
    ("engine-mix", {"engine": "reference"}, {"engine": "vllm"}, "engines differ"),
    ("block-unknown", {"block_size": None}, {}, "block_size unknown"),
    ("model-unknown", {}, {"model": None}, "model unknown"),
    ("ref-same", {"engine": "reference", "fp": "f1"}, {"engine": "reference", "fp": "f1"}, None),
    ("ref-tp4-to-tp8", {"engine": "reference", "tp": 4, "block_size": 4096, "fp": "f1"},
     {"engine": "reference", "tp": 8, "block_size": 2048, "fp": "f1"}, None),
    ("ref-tp8-to-dcp8", {"engine": "reference", "tp": 8, "block_size": 2048, "fp": "f1"},
     {"engine": "reference", "tp": 8, "dcp": 8, "block_size": 16384, "fp": "f1"}, None),
    ("ref-fingerprint-differs", {"engine": "reference", "fp": "f1"}, {"engine": "reference", "fp": "f2"},
     "layout fingerprints differ"),
    ("ref-tp-3", {"engine": "reference", "tp": 3, "fp": "f"}, {"engine": "reference", "fp": "f"},
     "not a power of two"),
    ("ref-dcp-on-prefill", {"engine": "reference", "tp": 2, "dcp": 2, "fp": "f"},
     {"engine": "reference", "tp": 2, "fp": "f"}, "prefill DCP"),
    ("ref-fingerprint-unknown", {"engine": "reference"}, {"engine": "reference"}, "layout fingerprint unknown"),
    ("ref-weights-differ", {"engine": "reference", "fp": "f", "weights": "seed31"},
     {"engine": "reference", "fp": "f", "weights": "seed7"}, "weights or tokenizer differ"),
    ("ref-weights-unknown", {"engine": "reference", "fp": "f", "weights": None}, {"engine": "reference", "fp": "f"},
     "p: weights fingerprint unknown"),
    ("vllm-paths-differ", {"weights": "path /models/a"}, {"weights": "path /models/b"}, "weights or tokenizer differ"),
    ("vllm-no-paths", {"weights": None}, {"weights": None}, None),
    ("vllm-one-path", {"weights": "path /models/a"}, {"weights": None}, "d: weights identity unknown"),
    ("ref-block-not-pow2", {"engine": "reference", "block_size": 24, "fp": "f"},
     {"engine": "reference", "fp": "f"}, "not a power of two"),
]


@pytest.mark.parametrize("case_id,p_kw,d_kw,expected", CASES, ids=[c[0] for c in CASES])
def test_pair_verdict(case_id, p_kw, d_kw, expected):
    verdict = pair_verdict(geo("p", **p_kw), geo("d", **d_kw))
    if expected is None:
        assert verdict.is_compatible, verdict.reasons
    else:
        assert not verdict.is_compatible
        assert any(expected in reason for reason in verdict.reasons), verdict.reasons


def test_matrix_covers_every_pair():
    prefills = [geo("p0", tp=1), geo("p1", tp=3)]
    decodes = [geo("d0", tp=2), geo("d1", tp=3)]
    matrix = compat_matrix(prefills, decodes)
    assert {k: v.is_compatible for k, v in matrix.items()} == {
        ("p0", "d0"): True, ("p0", "d1"): True, ("p1", "d0"): False, ("p1", "d1"): True}


def test_move_matrix_pairs_reference_decodes_tp_source_to_any_compatible_destination():
    """Decode -> decode moves (a grown session's KV): a TP decode instance may feed a DCP one (the TP -> DCP
    remap), never itself; a DCP source (rows split by token) and a vLLM instance never move."""
    tp = geo("tp-0", engine="reference", tp=1, block_size=1024, fp="f1")
    dcp = geo("dcp-0", engine="reference", tp=2, dcp=2, block_size=1024, fp="f1")
    other = geo("tp-1", engine="reference", tp=1, block_size=1024, fp="f2")
    vllm = geo("v-0")
    matrix = move_matrix([tp, dcp, other, vllm])
    compatible = {key for key, verdict in matrix.items() if verdict.is_compatible}
    assert compatible == {("tp-0", "dcp-0")}
    assert ("tp-0", "tp-0") not in matrix and ("v-0", "tp-0") not in matrix
    assert matrix[("dcp-0", "tp-0")].reasons and matrix[("tp-0", "tp-1")].reasons
