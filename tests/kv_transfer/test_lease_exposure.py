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



@pytest.mark.parametrize("leases", [
    [([10, 11, 12, 13], 11, 0, ROW), ([12], 12, 3 * ROW // 4, ROW // 4), ([10, 11, 12, 13], 13, 0, ROW // 8)],
    [([2, 3, 4], 2, 0, ROW // 8), ([3], 3, 0, ROW // 8), ([2, 3, 4], 4, ROW // 4, ROW // 8)],
], ids=["same-rows-again", "wider-lease"])
def test_a_lease_whose_regions_overlap_earlier_leases_reads_any_piece_of_its_rows(pair, leases):
    """The soak's READ refusals on the DCP ranks ("no specified or potential backend had the required
    registrations"): a reader kept every lease's sections of a peer loaded, and rows are exposed again for later
    leases as regions that overlap the earlier ones. NIXL finds a descriptor's region by binary search over a list
    it assumes does not overlap, so a piece inside a live lease's region (a DCP rank reads sub-blocks) was refused
    once an older, smaller region sorted just before it. Each lease, in turn, reads a piece of one of its rows."""
    p, d, endpoint = pair
    for index, (rows, row, offset, length) in enumerate(leases):
        exposure, sections = p.call("expose", rows=rows)
        lease = dataclasses.replace(endpoint, sections=sections)
        result = d.call("read_plan", d_rank=0, ops=[ReadOp(0, row, offset, length, row, offset)],
                        endpoints={0: lease}, lease_id=f"overlap-{index}", timeout=60)
        assert result["results"] == [("DONE", length)], (rows, result)
        p.call("unexpose", exposure=exposure)


def test_a_refused_read_waits_for_the_running_reads_of_its_peer_then_reads_on_a_fresh_entry(pair):
    """The reload that fixes an overlapping layout drops the peer's entry, which would fail the READs from that peer
    still running: the second request's READ is posted only once the first one's is not running (at once when the
    first READ was done by its post, as CPU reads of a row often are; the waiting itself:
    tests/kv_transfer/test_reads.py), and both end DONE."""
    p, d, endpoint = pair
    wide, wide_sections = p.call("expose", rows=[20, 21, 22])
    wide_lease = dataclasses.replace(endpoint, sections=wide_sections)
    first = d.call("read_plan", d_rank=0, ops=[ReadOp(0, 20, 0, ROW, 20, 0)], endpoints={0: wide_lease},
                   lease_id="busy-w", timeout=60)  # the wide lease's sections are loaded first
    assert first["results"] == [("DONE", ROW)]
    narrow, narrow_sections = p.call("expose", rows=[21])
    requests = [(dataclasses.replace(endpoint, sections=narrow_sections), [ReadOp(0, 21, 0, ROW, 21, 0)], "busy-0"),
                (dataclasses.replace(endpoint, sections=wide_sections), [ReadOp(0, 22, ROW // 4, ROW // 8, 22, ROW // 4)],
                 "busy-1")]
    result = d.call("read_while_busy", requests=requests)
    assert result["results"] == [[("DONE", ROW)], [("DONE", ROW // 8)]]
    assert _rows(d, [21]) == [True]
    p.call("unexpose", exposure=narrow)
    p.call("unexpose", exposure=wide)
