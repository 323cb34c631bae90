"""The fast decode step (engine/fast/decoder.py, through FastModel) against the reference KimiModel.decode on
kimi-k3.1-mini: both decode the same batch from the same packed pool (prompts prefilled by the reference).

- fp32 weights and activations (`dtype=float32`): logits within 1e-2 of their range (1e-3 under the interpreter; on the GPU
  top-k near-ties and cuBLAS summation order add to it) (what is left: the bf16
  query/probabilities inside the sparse MLA kernel and fp32 index dots), greedy tokens equal.
- bf16 (the production setting): on this random-init model bf16 activations move logits by up to ~10% of
  their range (bf16 weights alone: ~0.5%); greedy tokens must agree where the reference's top-2 margin is
  over 15% of the range.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.cache import RowPool, RowSequenceCache
from engine.fast.decoder import FastDecoder, gemv_kernels
from engine.fast.graphs import GraphedDecode
from engine.fast.model import FastModel
from engine.fast.pages import build_page_batch
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.weights import build_model

MINI = get_preset("kimi-k3.1-mini")


def _prefilled(model, pool: RowPool, lengths: list[int], spare: int,  # type: ignore[no-untyped-def]
               gen: torch.Generator) -> list:
    """One request per length, with `spare` more tokens of rows, its random prompt prefilled by the reference."""
    tables = []
    with torch.no_grad():
        for n in lengths:
            table = pool.allocate_request(n + spare)
            model.prefill(torch.randint(0, 256, (n,), generator=gen), RowSequenceCache(pool, table))
            tables.append(table)
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_decode_matches_reference_logits(dtype, device) -> None:  # type: ignore[no-untyped-def]
    model = build_model(MINI)
    layout = plan_layout(MINI)
    pool = RowPool(layout, MINI, 16)
    lengths = [40, 300, 520]  # one under top-k (256), two over
    tables = _prefilled(model, pool, lengths, 4, torch.Generator().manual_seed(0))
    ref_pool = copy.deepcopy(pool)
    tokens = torch.tensor([65, 66, 67])
    with torch.no_grad():
        ref = model.decode(tokens, lengths, [RowSequenceCache(ref_pool, t) for t in tables])
    fast_model = FastModel(model.to(device), layout, dtype)
    pool.buffer = pool.buffer.to(device)
    pool._flat = pool.buffer.view(-1)
    fast = fast_model.decode(tokens, lengths, [RowSequenceCache(pool, t) for t in tables]).cpu()
    span = float(ref.max() - ref.min())
    tight = dtype == torch.float32
    torch.testing.assert_close(fast, ref, rtol=0, atol=(1e-2 if tight else 0.12) * span)
    top2 = ref.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > (0 if tight else 0.15 * span)
    assert torch.equal(fast.argmax(-1)[sure], ref.argmax(-1)[sure])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and torch.compile of the segments need a GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-segments", "compiled-segments"])
def test_graphed_steps_equal_eager_steps(compiled) -> None:  # type: ignore[no-untyped-def]
    """GraphedDecode over a table loaded once (`set_pages`), then `step` with advancing positions: the same
    logits and the same pool bytes as eager decode steps (bit for bit with eager segments; compiled segments
    within bf16 rounding of the eager ones)."""
    device = torch.device("cuda")
    model = build_model(MINI, device=device)
    layout = plan_layout(MINI)
    pool = RowPool(layout, MINI, 24, device=device)
    lengths = [40, 300, 700]  # under and over top-k (256)
    gen = torch.Generator().manual_seed(1)
    tables = _prefilled(model, pool, lengths, 8, gen)
    attn, kda = [t.attn_row_ids for t in tables], [t.kda_row_ids for t in tables]
    full = build_page_batch(layout, attn, kda, [n + 7 for n in lengths], device)
    eager_buffer, scratch = pool.buffer.clone(), pool.buffer.clone()
    eager = FastDecoder(model, layout)
    graphed = GraphedDecode(FastDecoder(model, layout, compile=compiled), scratch, len(lengths),
                            full.subblock_ids.shape[1], layout.kda_groups, full,
                            torch.zeros(len(lengths), dtype=torch.int64, device=device))
    scratch.copy_(pool.buffer)  # capture ran one eager step on `scratch`: start the replays from the pool's bytes
    graphed.set_pages(full)
    for step in range(3):
        tokens = torch.randint(0, MINI.vocab_size, (len(lengths),), generator=gen).to(device)
        positions = [n + step for n in lengths]
        with gemv_kernels():  # the kernels the graph recorded, launched eagerly
            want = eager.decode(eager_buffer, tokens, build_page_batch(layout, attn, kda, positions, device))
        got = graphed.step(tokens, torch.tensor(positions, dtype=torch.int32)).clone()
        if compiled:
            span = float(want.max() - want.min())
            torch.testing.assert_close(got, want, rtol=0, atol=0.02 * span)
        else:
            assert torch.equal(got, want)
            assert torch.equal(scratch, eager_buffer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and torch.compile of the segments need a GPU")
def test_engine_graphed_steps_match_eager_steps() -> None:
    """FastModel's CUDA-graphed decode (engine/fast/graphs.py DecodeGraphs) against the same compiled decoder
    stepped eagerly on a copy of the pool: batches of 3, 2 and 1 requests (padded to the buckets 4, 2, 1) over
    two page-table buckets (16 and 32 pages), then a batch above the buckets (eager). What the graphs add is the
    padding, the buckets and the scratch request: logits within 2% of their range (a padded batch sums some
    reductions in another order; 0.6% at most on an H200), greedy tokens equal where the top-2 margin is clear,
    and rows outside the requests' and the scratch request's never written. (Compiled against uncompiled
    segments is the graphed-step test above; on this pool one request's logits move by ~9% of the range there,
    a near-tie of the random-weight model's routing or indexer that bf16 rounding flips.)"""
    from engine.fast.graphs import DecodeGraphs
    from engine.fast.model import page_batch_on_pool

    device = torch.device("cuda")
    model = build_model(MINI, device=device)
    layout = plan_layout(MINI)
    pool = RowPool(layout, MINI, 48, device=device)
    lengths = [40, 300, 700, 1100]  # 1, 5, 11 and 18 pages: page buckets 16 and 32
    gen = torch.Generator().manual_seed(2)
    tables = _prefilled(model, pool, lengths, 8, gen)
    eager_pool = copy.deepcopy(pool)
    graphed = FastModel(model, layout, graphs=True)
    assert graphed.graphs and not FastModel(model, layout, graphs=False).graphs
    eager = FastDecoder(model, layout, compile=True)
    used = {r for t in tables for r in (*t.attn_row_ids, *t.kda_row_ids)}
    next_pos = list(lengths)
    for batch in ([0, 1, 2], [3, 0], [1], [0, 1, 2, 3]):
        tokens = torch.randint(0, MINI.vocab_size, (len(batch),), generator=gen)
        positions = [next_pos[i] for i in batch]
        eager_caches = [RowSequenceCache(eager_pool, tables[i]) for i in batch]
        with torch.no_grad():
            want = eager.decode(eager_pool.buffer, tokens.to(device),
                                page_batch_on_pool(eager, layout, positions, eager_caches))
        if len(batch) == 4:  # above the buckets of this test: the eager path
            graphed._graphs_for(pool).batch_buckets = (1, 2)
        got = graphed.decode(tokens, positions, [RowSequenceCache(pool, tables[i]) for i in batch])
        span = float(want.max() - want.min())
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * span, msg=lambda m: f"batch {batch}: {m}")
        top2 = want.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 0.05 * span
        assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure])
        for i in batch:
            next_pos[i] += 1
    graphs = graphed._graphs_for(pool)
    assert isinstance(graphs, DecodeGraphs) and set(graphs.graphs) == {(4, 16), (2, 32), (1, 16)}
    scratch = set(graphs.scratch_table.attn_row_ids) | set(graphs.scratch_table.kda_row_ids)
    untouched = [r for r in range(pool.num_rows) if r not in used and r not in scratch]
    assert untouched and torch.equal(pool.buffer[untouched], eager_pool.buffer[untouched])


def test_warm_up_decodes_each_bucket_and_frees_its_rows(device) -> None:  # type: ignore[no-untyped-def]
    """FastModel.warm_up (what a CUDA node runs before its first request: compilation and one decode graph per
    batch bucket) on a pool that already serves a request: it decodes the bucket sizes up to max_batch, frees
    every row it took and leaves the serving request's rows as they were. (Here without graphs, through the
    Triton interpreter on CPU: the same prefill and decode calls.)"""
    model = build_model(MINI).to(device)
    layout = plan_layout(MINI)
    pool = RowPool(layout, MINI, 16, device=device)
    table = pool.allocate_request(40)
    pool.buffer[table.attn_row_ids] = 7  # a serving request's bytes
    before, free = pool.buffer.clone(), pool.num_free
    fast = FastModel(model, layout, graphs=False)
    # Short prompts of 8 tokens and a long one of 24 (a node's defaults, 16 and the indexer's top-k + 16, are
    # slow under the interpreter).
    assert fast.warm_up(pool, max_batch=3, prompt_tokens=8, long_tokens=24) == [1, 2]
    assert list(fast.warm_up_seconds) == ["prefill", "prefill_continued", "decode_b1", "decode_b2",
                                          "prefill_long"]  # the node logs them per phase
    assert all(seconds > 0 for seconds in fast.warm_up_seconds.values())
    assert pool.num_free == free and torch.equal(pool.buffer[table.row_ids], before[table.row_ids])
    # A prefill node (max_batch 0) decodes nothing, and a long prompt the pool cannot hold beside its serving
    # request is left out, saying so by its absence.
    too_long = pool.num_free * pool.layout.block_size + 1
    assert fast.warm_up(pool, max_batch=0, prompt_tokens=8, long_tokens=too_long) == [] and pool.num_free == free
    assert list(fast.warm_up_seconds) == ["prefill", "prefill_continued"]
