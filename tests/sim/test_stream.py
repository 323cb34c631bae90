"""What the client sees of a stream: SSE chunks (sim/stream.py) and the first token of an imported request, which
the decode node sends with its second (the node's round applies StartDecode, steps, then sends the events)."""

from __future__ import annotations

import random

import pytest

from loadgen.scenarios.trace import TraceEntry, TraceWorkload
from sim.calibrate import first_chunk_share, stream_probabilities
from sim.profile import HttpCost, StreamModel, TransferCost
from sim.run import SimOptions, simulate
from sim.stream import chunk_times
from tests.sim.helpers import cluster, profile

COLOCATED = {"disagg_min_uncached_tokens": 1_000_000}
ONE_STEP = {"max_step_tokens": None, "prefix_cache": False, "num_rows": 4096}


def _trace(n: int, input_len: int, output_len: int, gap_s: float = 10.0) -> TraceWorkload:
    entries = [TraceEntry(i + 1, i * gap_s, input_len, output_len, ()) for i in range(n)]
    return TraceWorkload(entries, "spaced", block_tokens=64)


def _level(prof, router: dict, workload: TraceWorkload, record_chunks: bool = True):
    opts = SimOptions(concurrency_levels=[1], duration_s=1e6, out_dir=None, drain_s=1e6, record_chunks=record_chunks)
    return simulate(cluster(ONE_STEP, router), prof, workload, workload.name, opts).summary.levels[0]


@pytest.mark.parametrize("record_chunks", [True, False])
def test_imported_first_token_leaves_with_the_decode_nodes_first_step(record_chunks: bool) -> None:
    """One disaggregated request alone: TTFT = router + P's prefill step + both legs + the READ + D's first decode
    step (base + one sequence + its context: prompt and first token), every later token one step apart; without
    chunk times (`--no-chunk-times`) the TTFT and the last token's time are the same."""
    base, tok, seq, ctx = 0.01, 0.001, 0.002, 1e-5
    http = HttpCost(router_s=0.002, prefill_leg_s=0.03, decode_leg_s=0.004)
    prof = profile(base_s=base, token_s=tok, seq_s=seq, ctx_s=ctx, http=http).model_copy(
        update={"transfer": TransferCost(bytes_per_s=1e30)})
    level = _level(prof, {}, _trace(1, 100, 3), record_chunks)
    n = 101  # BOS + 100 words
    d_step = base + seq + ctx * (n + 1)
    expected = 0.002 + (base + tok * n) + 0.03 + 0.004 + d_step
    record = level.records[0]
    assert record.ttft_s == pytest.approx(expected, abs=1e-9)
    assert record.e2e_s == pytest.approx(expected + base + seq + ctx * (n + 2), abs=1e-9)
    if record_chunks:
        assert record.chunk_s[1] - record.chunk_s[0] == pytest.approx(0.0, abs=1e-12)  # tokens 1 and 2 together


def test_chunks_are_tokens_that_release_text_and_the_last() -> None:
    """Colocated requests of 40 tokens, decode steps of D each: every chunk is at a token's time, the last token
    always ends one, TTFT is the first chunk and TPOT spans first to last chunk over 39; about 1 + p * 39 chunks a
    request; the same run again gives the same chunks."""
    d, p, n_out = 0.02, 0.25, 40
    prof = profile(base_s=d).model_copy(update={"stream": StreamModel(text_token_p=p)})
    workload = _trace(200, 20, n_out)
    level = _level(prof, COLOCATED, workload)
    again = _level(prof, COLOCATED, workload)
    counts = []
    for record, same in zip(level.records, again.records):
        start = record.start_s
        token_times = [start + d * (k + 1) for k in range(n_out)]  # prefill step, then one token a step
        assert all(any(abs(t - c) < 1e-9 for t in token_times) for c in record.chunk_s)
        assert record.chunk_s[-1] == pytest.approx(token_times[-1], abs=1e-9)
        assert record.ttft_s == pytest.approx(record.chunk_s[0] - start, abs=1e-9)
        assert record.tpot_s == pytest.approx((record.chunk_s[-1] - record.chunk_s[0]) / (n_out - 1), abs=1e-9)
        assert same.chunk_s == record.chunk_s
        counts.append(len(record.chunk_s))
    assert sum(counts) / len(counts) == pytest.approx(1 + p * (n_out - 1), rel=0.08)


def test_a_chunking_profile_needs_chunk_times() -> None:
    prof = profile().model_copy(update={"stream": StreamModel(text_token_p=0.5)})
    with pytest.raises(ValueError, match="chunk times"):
        _level(prof, COLOCATED, _trace(1, 10, 4), record_chunks=False)


@pytest.mark.parametrize("n_tokens", [2, 16, 33])
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("first_p", [None, 0.45])
def test_first_chunk_share_is_the_mean_span_of_simulated_streams(n_tokens: int, p: float, first_p: float | None) -> None:
    """calibrate's correction of a measured TPOT against sim/stream.py's chunks of an imported stream (its first
    two tokens at one time, then one a step), the first token releasing text with its own probability or p."""
    times = [1.0] + [float(k) for k in range(1, n_tokens)]
    spans = []
    rng = random.Random(5)
    for _ in range(20_000):
        chunks = chunk_times(times, p, str(rng.random()), first_p)
        spans.append((chunks[-1] - chunks[0]) / (n_tokens - 1))
    assert first_chunk_share(n_tokens, p, first_p=first_p) == pytest.approx(sum(spans) / len(spans), abs=0.01)


def test_the_first_token_releases_text_with_its_own_probability() -> None:
    """Streams of 3 tokens at p = 0.1 and first_token_p = 0.6: the first token ends a chunk in about 60% of them, the
    second in about 10%, the last in all; first_token_p None is text_token_p's."""
    rng = random.Random(7)
    firsts = seconds = 0
    n = 20_000
    for _ in range(n):
        chunks = chunk_times([0.0, 1.0, 2.0], 0.1, str(rng.random()), 0.6)
        assert chunks[-1] == 2.0
        firsts += 0.0 in chunks
        seconds += 1.0 in chunks
    assert firsts / n == pytest.approx(0.6, abs=0.015) and seconds / n == pytest.approx(0.1, abs=0.01)
    assert chunk_times([0.0, 1.0, 2.0], 0.3, "k") == chunk_times([0.0, 1.0, 2.0], 0.3, "k", None)
    assert not StreamModel(text_token_p=1.0, first_token_p=0.5).is_every_token
    assert StreamModel(text_token_p=1.0).is_every_token


def test_stream_probabilities_split_the_first_token_from_later_ones_and_need_counts() -> None:
    """Two-token streams measure the first token (a chunk after the first: it released text); longer streams'
    later chunks less their first tokens' measure the rest. Without two-token points both are the pooled share."""
    measured = {"a": {"later_chunks": 3, "later_tokens": 30, "num_ok": 1},
                "b": {"later_chunks": 7, "later_tokens": 70, "num_ok": 1}}
    assert stream_probabilities(measured) == pytest.approx((0.1, 0.1))
    # 10 two-token streams, 4 with a second chunk; 4 streams of 51 tokens with 0.4 * 4 + 0.1 * 49 * 4 later chunks
    split = {"short": {"later_chunks": 4, "later_tokens": 10, "num_ok": 10},
             "long": {"later_chunks": 0.4 * 4 + 0.1 * 49 * 4, "later_tokens": 50 * 4, "num_ok": 4}}
    assert stream_probabilities(split) == pytest.approx((0.4, 0.1), rel=1e-12)
    with pytest.raises(ValueError, match="chunk counts"):
        stream_probabilities({"a": {"ttft_s": 1.0}})
