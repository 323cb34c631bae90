"""A decode segment (many decode steps as one event, sim/instance.py) times every token as one event per step
would: the same requests, the same token counts, and every chunk at the same time (to float rounding: a segment
sums its steps in closed form)."""

from __future__ import annotations

import pytest

from loadgen.scenarios.trace import TraceEntry, TraceWorkload
from sim.decode_batch import DecodeBatch
from sim.run import SimOptions, simulate
from tests.sim.helpers import cluster, profile

SETTINGS = {"max_step_tokens": 256, "prefix_cache": True, "num_rows": 64, "max_batch": 6}


def _run(monkeypatch: pytest.MonkeyPatch, step_by_step: bool, router: dict) -> tuple[list, int]:
    """(records by request id, events run)."""
    if step_by_step:  # every segment one step long: one event per decode step
        real = DecodeBatch.next_event_step

        def one_step(self: DecodeBatch) -> int | None:
            step = real(self)
            return None if step is None else min(step, self.steps + 1)

        monkeypatch.setattr(DecodeBatch, "next_event_step", one_step)
    # overlapping arrivals cut segments; prompts near the 1024-token block cross boundaries while decoding; shared
    # leading blocks (hash ids) hit the prefix cache; more requests than max_batch wait for a place in the batch
    entries = [TraceEntry(i + 1, 0.013 * i, 900 + 37 * (i % 5), 40 + 29 * (i % 7), (i % 3,)) for i in range(24)]
    workload = TraceWorkload(entries, "overlapping", block_tokens=512)
    opts = SimOptions(concurrency_levels=[8], duration_s=1e6, out_dir=None, drain_s=1e6, record_chunks=True)
    prof = profile(base_s=0.004, token_s=2e-6, seq_s=3e-4, ctx_s=2e-7)
    result = simulate(cluster(SETTINGS, router), prof, workload, workload.name, opts)
    monkeypatch.undo()
    return sorted(result.summary.levels[0].records, key=lambda r: r.request_id), result.num_events


@pytest.mark.parametrize("router", [{}, {"disagg_min_uncached_tokens": 1_000_000}], ids=["pd", "colocated"])
def test_segments_time_tokens_as_single_steps(monkeypatch: pytest.MonkeyPatch, router: dict) -> None:
    fast, fast_events = _run(monkeypatch, False, router)
    slow, slow_events = _run(monkeypatch, True, router)
    assert fast_events < slow_events * 0.6  # the fast path ran segments of many steps
    assert [r.outcome for r in fast] == ["ok"] * 24
    assert [(r.request_id, r.completion_tokens, r.cached_tokens) for r in fast] == \
        [(r.request_id, r.completion_tokens, r.cached_tokens) for r in slow]
    for a, b in zip(fast, slow):
        assert len(a.chunk_s) == len(b.chunk_s) == a.completion_tokens
        assert a.chunk_s == pytest.approx(b.chunk_s, rel=1e-12, abs=1e-12)
        assert a.ttft_s == pytest.approx(b.ttft_s, rel=1e-12, abs=1e-12)
