"""Per-lease exposure with real NIXL between two processes: a prefill rank registers no row up front, so the
metadata its side channel serves addresses nothing; a reader given one lease's sections reads exactly those rows
and is refused any other row; an unexposed lease's rows can be exposed again for another lease and read through
its own sections. (NIXL refuses on the reader's side; what the transport itself enforces: docs/NODE_SURFACE.md.)"""

from __future__ import annotations

import dataclasses
import multiprocessing

import numpy as np
import pytest

from kv_transfer.remap import ReadOp
from tests.kv_transfer.rank_process import RankProcess, pool_pattern

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]
ROW = 4096
POOL = 64 * ROW


@pytest.fixture(scope="module")
def pair():
    ctx = multiprocessing.get_context("spawn")
    p = RankProcess(ctx, "expose-P", POOL, per_lease=True)
    d = RankProcess(ctx, "expose-D", POOL)
    try:
        p.ready(120)
        d.ready(120)
        endpoint = p.call("fill", seed=21, row_bytes=ROW, rank=0, cheap=True)
        d.call("zero", row_bytes=ROW, rank=0)
        yield p, d, endpoint
    finally:
        p.stop()
        d.stop()


def _read(d: RankProcess, endpoint, rows: list[int], lease: str) -> dict:
    ops = [ReadOp(0, row, 0, ROW, row, 0) for row in rows]  # each row to the same row of D's pool
    return d.call("read_plan", d_rank=0, ops=ops, endpoints={0: endpoint}, lease_id=lease, timeout=60)


def _rows(d: RankProcess, rows: list[int]) -> list[bool]:
    src = np.resize(pool_pattern(21, 4099), POOL)
    pool = np.frombuffer(d.call("pool"), dtype=np.uint8)
    return [bool(np.array_equal(pool[r * ROW:(r + 1) * ROW], src[r * ROW:(r + 1) * ROW])) for r in rows]


def test_side_channel_metadata_addresses_no_row(pair):
    p, d, endpoint = pair
    assert not endpoint.sections
    with pytest.raises(RuntimeError, match="NIXL refused the READ"):
        _read(d, endpoint, [3], "L0")
    assert _rows(d, [3]) == [False]


def test_a_lease_reads_its_rows_and_no_other(pair):
    p, d, endpoint = pair
    exposure, sections = p.call("expose", rows=[3, 4, 9])
    lease = dataclasses.replace(endpoint, sections=sections)
    assert _read(d, lease, [3, 4, 9], "L1")["results"] == [("DONE", 3 * ROW)]
    assert _rows(d, [3, 4, 9]) == [True, True, True]
    for outside in ([5], [2], [9, 10]):  # beside the lease's regions, and one running past its end
        with pytest.raises(RuntimeError, match="NIXL refused the READ"):
            _read(d, lease, outside, "L1")
    assert _rows(d, [5, 2, 10]) == [False, False, False]
    p.call("unexpose", exposure=exposure)
    again, sections2 = p.call("expose", rows=[4, 5])  # row 4 again, for another lease
    assert _read(d, dataclasses.replace(endpoint, sections=sections2), [5], "L2")["results"] == [("DONE", ROW)]
    assert _rows(d, [5]) == [True]
    p.call("unexpose", exposure=again)
