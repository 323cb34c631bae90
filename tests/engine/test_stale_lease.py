"""Exported rows have one owner: a release names a request id AND an export generation, aborts of exported or
importing requests quarantine the rows, so a stale lease (issue 13's repro) can never free another request's rows."""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(quarantine_s: float, clock: Clock) -> Engine:
    return Engine(EngineConfig(num_rows=32, quarantine_s=quarantine_s), clock=clock)


@pytest.mark.parametrize("quarantine_s", [0.0, 30.0], ids=["no-quarantine", "quarantine"])
def test_stale_lease_engine_cannot_free_another_requests_rows(quarantine_s):
    """The issue's repro: A exported, aborted (its lease not told), B exported; A's lease ends later. With no
    quarantine B is handed A's very rows (the dangerous case); either way A's release frees nothing of B's."""
    clock = Clock()
    e = _engine(quarantine_s, clock)
    sampling = SamplingParams(max_tokens=1)
    a = e.prefill_and_keep("A", [256, 1, 2], sampling)
    assert e.abort("A")
    b = e.prefill_and_keep("B", [256, 7, 7], sampling)
    a_rows, b_rows = set(a.attn_row_ids + a.kda_row_ids), set(b.attn_row_ids + b.kda_row_ids)
    if quarantine_s:
        assert not a_rows & b_rows  # A's rows are quarantined: a READ of A's lease cannot see B's bytes
    else:
        assert a_rows == b_rows  # the allocator handed B exactly A's rows: the stale lease's target
    free = e.num_free_rows
    assert not e.release("A", a.generation)  # A's stale lease: nothing to free
    assert not e.release("B", a.generation)  # the old generation does not name B's export either
    assert e.num_free_rows == free and e.request_state("B") is not None
    clock.now += quarantine_s + 1
    e.reclaim()
    assert e.release("B", b.generation, reads_done=True)
    assert e.num_free_rows == 32 and e.num_quarantined_rows == 0


def test_released_and_aborted_rows_wait_out_the_quarantine():
    clock = Clock()
    e = _engine(10.0, clock)
    a = e.prefill_and_keep("A", [256, 1, 2], SamplingParams(max_tokens=1))
    num = len(a.attn_row_ids + a.kda_row_ids)
    assert e.release("A", a.generation)  # given up (lease expired): quarantined
    assert e.num_free_rows == 32 - num and e.num_quarantined_rows == num
    clock.now += 9.9
    assert e.reclaim() == [] and e.num_quarantined_rows == num
    clock.now += 0.2
    assert sorted(e.reclaim()) == sorted(a.attn_row_ids + a.kda_row_ids) and e.num_free_rows == 32
    table = e.allocate_for_import("D", [256, 3, 4], SamplingParams(max_tokens=4))
    assert e.abort("D") and e.num_quarantined_rows == len(table.row_ids)  # an abandoned import: quarantined too
    clock.now += 11
    e.reclaim()
    assert e.num_free_rows == 32


def test_held_rows_never_return():
    """A READ that could not be cancelled: the rows stay out of the pool whether the hold comes first or last."""
    clock = Clock()
    e = _engine(1.0, clock)
    first = e.allocate_for_import("X", [256, 3, 4], SamplingParams(max_tokens=4))
    assert e.hold("X") and e.abort("X")  # hold, then the abort
    second = e.allocate_for_import("Y", [256, 5, 6], SamplingParams(max_tokens=4))
    assert e.abort("Y") and e.hold("Y")  # the abort, then the hold
    assert not e.hold("nobody")
    clock.now += 1e9
    e.reclaim()
    assert e.num_quarantined_rows == len(first.row_ids) + len(second.row_ids)
    assert e.num_free_rows == 32 - e.num_quarantined_rows


def test_an_abort_that_no_read_can_follow_frees_the_rows_at_once():
    """`abort(..., reads_done=True)`: the prefill node's exporter knows no reader claimed the export (none can
    now), so its rows are free at once, not quarantined; a held request's rows still stay out for good."""
    clock = Clock()
    e = _engine(30.0, clock)
    a = e.prefill_and_keep("A", [256, 1, 2], SamplingParams(max_tokens=1))
    assert e.abort("A", reads_done=True)
    assert e.num_free_rows == 32 and e.num_quarantined_rows == 0
    b = e.prefill_and_keep("B", [256, 7, 7], SamplingParams(max_tokens=1))
    assert set(b.attn_row_ids + b.kda_row_ids) == set(a.attn_row_ids + a.kda_row_ids)
    assert e.hold("B") and e.abort("B", reads_done=True)
    assert e.num_quarantined_rows == len(b.attn_row_ids + b.kda_row_ids)
