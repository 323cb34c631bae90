"""PendingReads' bookkeeping over a scripted transport (the transfer itself is tested over real NIXL in
test_nixl_transfer.py and tests/decode_node/test_stalled_read.py): one READ per source rank with its DONE
notification, no blocking poll, repost once after a stall, a deadline, and a READ NIXL would not cancel reported
as `uncancelled` (its rows must stay out of use)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from kv_transfer.lease import done_message
from kv_transfer.reads import PendingReads
from kv_transfer.remap import ReadOp, ReadPlan
from kv_transfer.transport import PeerBusy, RankEndpoint, ReadResult, TransferError, TransferState
from kv_transfer.ucx_env import KVTransferSettings


@dataclass
class Handle:
    peer: RankEndpoint
    notif: bytes
    nbytes: int = 8
    state: TransferState = TransferState.PROC
    t_start: float = field(default_factory=time.perf_counter)


class ScriptedTransport:
    def __init__(self, settings: KVTransferSettings, refuse_release: bool = False) -> None:
        self.settings = settings
        self.refuse_release = refuse_release
        self.busy: set[str] = set()
        """Peers whose READs cannot be posted now (PeerBusy, as NixlTransport while its entry must be reloaded)."""
        self.posted: list[Handle] = []
        self.released: list[Handle] = []
        self.reposts = 0

    def post_read(self, peer, ops, notif=b""):
        if peer.agent_name in self.busy:
            raise PeerBusy(f"{peer.agent_name} busy")
        handle = Handle(peer, notif)
        self.posted.append(handle)
        return handle

    def poll(self, handle):
        return handle.state

    def repost(self, handle):
        self.reposts += 1
        return self.post_read(handle.peer, (), handle.notif)

    def release(self, handle):
        if self.refuse_release and handle.state is TransferState.PROC:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.released.append(handle)

    def result(self, handle):
        return ReadResult(handle.state, handle.nbytes, 1, None, 0.0, 0.0)


def _endpoint(rank: int) -> RankEndpoint:
    return RankEndpoint(rank, f"P{rank}", b"", 0, 1 << 20, 4096, 256)


def _reads(transport, timeout_s: float = 60.0) -> PendingReads:
    plan = ReadPlan({0: [ReadOp(0, 1, 0, 8, 2, 0), ReadOp(1, 3, 0, 8, 4, 0)]})
    return PendingReads(transport, 0, plan, {0: _endpoint(0), 1: _endpoint(1)}, "L", timeout_s)


def test_posts_one_read_per_source_and_completes_without_blocking():
    transport = ScriptedTransport(KVTransferSettings())
    reads = _reads(transport)
    assert [h.notif for h in transport.posted] == [done_message("L", "0.0", 2), done_message("L", "0.1", 2)]
    assert not reads.poll()
    transport.posted[0].state = TransferState.DONE
    assert not reads.poll()
    transport.posted[1].state = TransferState.DONE
    assert reads.poll() and [r.bytes for r in reads.results()] == [8, 8]
    assert reads.close() and len(transport.released) == 2 and not reads.uncancelled


def test_a_stalled_read_is_reposted_once_and_an_error_fails():
    transport = ScriptedTransport(KVTransferSettings(repost_after_s=0.01))
    reads = _reads(transport)
    time.sleep(0.02)
    assert not reads.poll() and transport.reposts == 2 and len(transport.released) == 2  # old handles cancelled
    time.sleep(0.02)
    assert not reads.poll() and transport.reposts == 2  # once per read
    reads.handles[0].state = TransferState.ERR
    with pytest.raises(TransferError, match="failed"):
        reads.poll()
    assert reads.close()


def test_deadline_and_uncancelled_reads():
    transport = ScriptedTransport(KVTransferSettings(), refuse_release=True)
    reads = _reads(transport, timeout_s=0.01)
    time.sleep(0.02)
    with pytest.raises(TransferError, match="still running"):
        reads.poll()
    assert not reads.close() and reads.uncancelled  # its READs may still land: the caller holds the rows


def test_a_read_whose_peer_is_busy_is_posted_by_a_later_poll_within_the_deadline():
    """NixlTransport answers PeerBusy while the READs from a peer whose entry it must reload still run: the
    request's READ waits (nothing failed, the other source's READ runs) and a later poll posts it."""
    transport = ScriptedTransport(KVTransferSettings())
    transport.busy.add("P1")
    reads = _reads(transport)
    assert [h.peer.agent_name for h in transport.posted] == ["P0"]
    transport.posted[0].state = TransferState.DONE
    assert not reads.poll() and len(transport.posted) == 1, "still busy: not posted, not failed"
    transport.busy.clear()
    assert not reads.poll() and [h.peer.agent_name for h in transport.posted] == ["P0", "P1"]
    assert transport.posted[1].notif == done_message("L", "0.1", 2)
    transport.posted[1].state = TransferState.DONE
    assert reads.poll() and [r.bytes for r in reads.results()] == [8, 8]
    assert reads.close() and len(transport.released) == 2


def test_a_read_whose_peer_stays_busy_fails_at_the_deadline():
    transport = ScriptedTransport(KVTransferSettings())
    transport.busy.add("P1")
    reads = _reads(transport, timeout_s=0.01)
    transport.posted[0].state = TransferState.DONE
    time.sleep(0.02)
    with pytest.raises(TransferError, match="could not be posted"):
        reads.poll()
    assert reads.close() and len(transport.released) == 1


def test_no_read_is_posted_once_the_deadline_has_passed():
    """A READ that completes inline (a small CMA read on an idle host) would succeed however short the deadline:
    past it, nothing is posted and the import fails (tests/e2e/test_link_breaker_cluster.py's `near` node relies
    on it to fail every hand-off)."""
    transport = ScriptedTransport(KVTransferSettings())
    reads = _reads(transport, timeout_s=1e-9)
    assert transport.posted == []
    with pytest.raises(TransferError, match="could not be posted"):
        reads.poll()
    assert transport.posted == [] and reads.close() and not reads.uncancelled
