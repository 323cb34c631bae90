"""NixlTransport.repost with other READs from the same peer still running: removing a remote agent makes NIXL
fail every transfer to it ("remote agent was invalidated or re-registered during transfer"), so a repost drops
and reloads the endpoint only when the stalled READ is the peer's last one running. NIXL's agent is replaced by a
recorder here (the real stall and repost: test_nixl_transfer.py::test_a_stalled_read_is_posted_again_...)."""

from __future__ import annotations

from kv_transfer.nixl_agent import NixlTransport
from kv_transfer.remap import ReadOp
from kv_transfer.transport import RankEndpoint, TransferState

ROW = 4096


class RecordingAgent:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.states: dict[int, str] = {}
        self.next = 0

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append("add")
        return b"peer-P0"

    def remove_remote_agent(self, name: str) -> None:
        self.calls.append("remove")

    def get_xfer_descs(self, descs, mem_type):  # type: ignore[no-untyped-def]
        return descs

    def initialize_xfer(self, op, local, remote, name, notif):  # type: ignore[no-untyped-def]
        self.next += 1
        self.states[self.next] = "PROC"
        return self.next

    def transfer(self, xfer: int) -> str:
        return "PROC"

    def check_xfer_state(self, xfer: int) -> str:
        return self.states[xfer]

    def release_xfer_handle(self, xfer: int) -> None:
        self.calls.append("release")


def _transport() -> tuple[NixlTransport, RecordingAgent]:
    t = object.__new__(NixlTransport)  # no NIXL agent: only the endpoint bookkeeping is under test
    agent = RecordingAgent()
    t._agent, t._peers, t._inflight, t._sections = agent, {}, {}, {}
    t.reads_failed = t.reads_reposted = 0
    t.row_bytes, t.pool_bytes, t.base_addr, t.device_id, t.mem_type = ROW, 64 * ROW, 1 << 20, 0, "DRAM"
    return t, agent


PEER = RankEndpoint(0, "P0", b"meta", 1 << 30, 64 * ROW, ROW, 64)


def test_repost_keeps_the_endpoint_while_other_reads_from_the_peer_run() -> None:
    t, agent = _transport()
    stalled = t.post_read(PEER, [ReadOp(0, 1, 0, ROW, 1, 0)])
    other = t.post_read(PEER, [ReadOp(0, 2, 0, ROW, 2, 0)])
    t.release(stalled)
    again = t.repost(stalled)
    assert agent.calls == ["add", "release"], agent.calls  # the endpoint of `other` was not removed
    assert t.poll(other) is TransferState.PROC and again.state is TransferState.PROC
    agent.states[2] = "DONE"
    assert t.poll(other) is TransferState.DONE
    t.release(again)
    third = t.repost(again)  # now the peer's only READ: a fresh endpoint
    assert agent.calls == ["add", "release", "release", "remove", "add"], agent.calls
    assert t.reads_reposted == 2 and third.state is TransferState.PROC
