"""Real NIXL between real processes: P -> D imports byte-exact for TP pairs, DCP, mixed block sizes;
incompatible pairs and bad params refused before any memory is touched; leases end exactly once."""

from __future__ import annotations

import os
import time

import httpx
import numpy as np
import pytest

from kv_transfer.cluster_auth import ClusterAuth
from kv_transfer.importer import plan_import
from kv_transfer.lease import done_message
from kv_transfer.signing import ClusterSecret
from tests.kv_transfer.cluster import (
    SECRET,
    Cluster,
    drain_notifications,
    expected_d_pool,
    export,
    start_import,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(420)]

CASES = {  # id: (P layout kwargs, D layout kwargs, tokens)
    "tp1-tp1-B1024-B2048": ({"tp_size": 1}, {"tp_size": 1, "block_size": 2048}, 4096),
    "tp2-tp1-B512-B1024": ({"tp_size": 2}, {"tp_size": 1}, 3000),
    "tp1-tp2-B2048-B512": ({"tp_size": 1, "block_size": 2048}, {"tp_size": 2}, 4096),
    "tp2-tp4-B512-B1024": ({"tp_size": 2}, {"tp_size": 4, "block_size": 1024}, 2500),
    "tp1-dcp2-B1024-u64": ({"tp_size": 1}, {"tp_size": 2, "dcp_size": 2, "dcp_interleave": 64}, 4096),
    "tp2-dcp4-B512-B2048-u128": ({"tp_size": 2}, {"tp_size": 4, "dcp_size": 4, "block_size": 2048,
                                                   "dcp_interleave": 128}, 3500),
}


@pytest.fixture(scope="module")
def nixl():
    """The harness's P and D rank processes and side channel (not tests/topologies.py's shared `cluster`)."""
    cl = Cluster()
    yield cl
    cl.close()


@pytest.mark.parametrize("case", list(CASES))
def test_import_is_byte_exact_and_frees_the_lease(nixl, case):
    p_kw, d_kw, n = CASES[case]
    req = export(nixl, p_kw, d_kw, n, seed=len(case))
    plan = plan_import(nixl.cfg, req.d, req.params, nixl.side.meta, req.d_attn, req.d_kda)
    start_import(nixl, req, d_kw)
    results = {r: nixl.d[r].recv(240) for r in range(req.d.tp_size)}
    for r, res in results.items():
        assert [x[0] for x in res] == ["DONE"] * len(plan.by_source(r))
        assert sum(x[2] for x in res) == len(plan.reads[r])  # one descriptor per merged op, one READ per source
        got = np.frombuffer(nixl.d[r].call("pool"), dtype=np.uint8)
        want = expected_d_pool(req, r)
        assert np.array_equal(got, want), f"D rank {r}: {int((got != want).sum())} bytes differ"
    counts = {}
    for d_rank, p_rank in plan.consumers():
        counts[p_rank] = counts.get(p_rank, 0) + 1
    assert drain_notifications(nixl, req, counts) == len(plan.consumers())
    assert req.leases.outstanding == 0 and req.leases.outcomes["notified"] == 1
    assert len(req.free.free) == req.free.idle


def _assert_untouched(nixl, req, ranks):
    for r in ranks:
        assert not np.frombuffer(nixl.d[r].call("pool"), dtype=np.uint8).any(), f"D rank {r} pool was written"
    assert nixl.p[0].notifs(1, 0.3) == []  # P heard nothing
    assert req.leases.outstanding == 1 and len(req.free.free) == req.free.idle - len(req.p_attn) - len(req.p_kda)


def test_incompatible_pair_refused_before_transfer(nixl):
    p_kw, d_kw = {"tp_size": 1}, {"tp_size": 1, "index_key_format": "mxfp4"}
    req = export(nixl, p_kw, {"tp_size": 1}, 2048, seed=3)
    start_import(nixl, req, d_kw, ranks=[0])
    with pytest.raises(RuntimeError, match="does not match D's"):
        nixl.d[0].recv(240)
    _assert_untouched(nixl, req, [0])


@pytest.mark.parametrize("change,match", [
    ({"remote_engine_id": "prefill-Z"}, "unknown remote_engine_id 'prefill-Z'"),
    ({"layout_fingerprint": "0123456789abcdef"}, "layout_fingerprint '0123456789abcdef' does not match"),
    ({"remote_block_ids": [[0, 99999]]}, r"out of range"),
    ({"lease_expiry": 1.0}, "expired"),
])
def test_bad_params_clear_error_no_memory_touched(nixl, change, match):
    req = export(nixl, {"tp_size": 1}, {"tp_size": 1}, 2048, seed=5)
    wire = req.params.to_wire() | change
    start_import(nixl, req, {"tp_size": 1}, params=wire, ranks=[0])
    with pytest.raises(RuntimeError, match=match):
        nixl.d[0].recv(240)
    _assert_untouched(nixl, req, [0])


class SteppedClock:
    """P's lease clock, advanced by the test (starts at the wall clock so D's expiry checks agree)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_abort_over_side_channel_frees_rows(nixl):
    req = export(nixl, {"tp_size": 2}, {"tp_size": 1}, 1024, seed=12)
    url = f"http://127.0.0.1:{nixl.side.port}/kv/leases/{req.params.lease_id}/abort"
    anonymous = httpx.post(url, json={"reader": "decode-a"}, timeout=10)  # anyone on the pod network: refused
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert req.leases.outstanding == 1
    auth = ClusterAuth(ClusterSecret(SECRET))
    claim = url.removesuffix("/abort") + "/claim"
    assert httpx.post(claim, json={"reader": "decode-a"}, timeout=10, auth=auth).status_code == 200
    second = httpx.post(claim, json={"reader": "decode-b"}, timeout=10, auth=auth)  # first claim wins
    assert second.status_code == 409 and "already redeemed" in second.json()["error"]["message"]
    other = httpx.post(url, json={"reader": "decode-b"}, timeout=10, auth=auth)  # only its reader ends it
    assert other.status_code == 403 and req.leases.outstanding == 1
    resp = httpx.post(url, json={"reader": "decode-a"}, timeout=10, auth=auth)
    assert resp.status_code == 200 and req.leases.outcomes["aborted"] == 1 and len(req.free.free) == req.free.idle
    again = httpx.post(url, json={"reader": "decode-a"}, timeout=10, auth=auth)
    assert again.status_code == 404 and "has ended" in again.json()["error"]["message"]


def test_metadata_needs_the_cluster_secret(nixl):
    """The agent metadata opens the pools to NIXL READs: only a member of the cluster gets it."""
    export(nixl, {"tp_size": 1}, {"tp_size": 1}, 1024, seed=13)
    url = f"http://127.0.0.1:{nixl.side.port}/kv/metadata"
    for auth in (None, ClusterAuth(ClusterSecret(b"not-the-cluster-secret-000"))):
        refused = httpx.get(url, timeout=10, auth=auth)
        assert refused.status_code == 401 and "agent_metadata" not in refused.text
    assert httpx.get(url, timeout=10, auth=ClusterAuth(ClusterSecret(SECRET))).json()["ranks"]


def test_forged_done_ends_no_lease(nixl):
    """An agent with P's metadata sends DONE notifications over NIXL for another request's lease: unsigned, and
    signed with a key of its own. P ends nothing; the reader's own signed DONEs still end the lease."""
    p_kw, d_kw = {"tp_size": 1}, {"tp_size": 1}
    req = export(nixl, p_kw, d_kw, 2048, seed=14)
    endpoint = nixl.side.meta.endpoints()[0]
    forged = [done_message(req.params.lease_id, "0.0", 1),
              done_message(req.params.lease_id, "0.0", 1, key=b"attacker-key-0123456789abcdef0")]
    for message in forged:
        nixl.d[3].call("send_notif", endpoint=endpoint, message=message)
    for _src, msg in nixl.p[0].notifs(len(forged), 30):
        with pytest.raises(ValueError, match="does not verify"):
            req.leases.apply_message(msg)
    assert req.leases.outstanding == 1 and req.leases.rejected_notifications == len(forged)
    assert len(req.free.free) == req.free.idle - len(req.p_attn) - len(req.p_kda)  # nothing freed early
    plan = plan_import(nixl.cfg, req.d, req.params, nixl.side.meta, req.d_attn, req.d_kda)
    start_import(nixl, req, d_kw)
    assert [x[0] for x in nixl.d[0].recv(240)] == ["DONE"] * len(plan.by_source(0))
    assert drain_notifications(nixl, req, {0: len(plan.consumers())}) == len(plan.consumers())
    assert req.leases.outcomes["notified"] == 1 and len(req.free.free) == req.free.idle


def test_reader_killed_mid_request_rows_freed_after_expiry(nixl):
    """Runs last: it kills D3 (the module's processes are shared; teardown copes with a dead one)."""
    clock = SteppedClock()
    req = export(nixl, {"tp_size": 1}, {"tp_size": 1}, 4096, seed=9, ttl_s=60.0, clock=clock)
    doomed = nixl.d[3]
    doomed.send("import", model="kimi-k3.1-mini", layout={"tp_size": 1}, d_rank=0, params=req.params.to_wire(),
                host="127.0.0.1", port=nixl.side.port, d_attn=req.d_attn, d_kda=req.d_kda, die_after_post=True,
                secret=SECRET, notify_key=b"")
    doomed.proc.join(120)
    if doomed.proc.exitcode is None and doomed.conn.poll(0):
        pytest.fail(f"the reader answered instead of dying: {doomed.conn.recv()}")
    assert doomed.proc.exitcode == 3
    assert nixl.p[0].notifs(1, 0.5) == []  # no completion notification
    expiry = req.leases.get(req.params.lease_id).expiry
    clock.now = expiry - 0.01
    assert req.leases.expire() == [] and req.leases.outstanding == 1  # still inside the lease: nothing freed
    clock.now = expiry
    assert req.leases.expire() == [req.params.lease_id]
    assert req.leases.outcomes["expired"] == 1 and len(req.free.free) == req.free.idle


def test_an_idle_agent_does_not_spin():
    """NIXL's UCX progress thread must sleep between passes (kv_transfer.ucx_env.progress_delay): with
    NIXL's own setting (0 us) an idle process burns a whole core, which on a small machine starves the ranks
    that compute. A real agent in a real process, after a READ has wired it up, idles below 25% of a core."""
    import multiprocessing

    from kv_transfer.remap import ReadOp
    from tests.kv_transfer.rank_process import RankProcess

    ctx = multiprocessing.get_context("spawn")
    p, d = RankProcess(ctx, "idle-P", 1 << 20), RankProcess(ctx, "idle-D", 1 << 20)
    try:
        p.ready(120)
        d.ready(120)
        endpoint = p.call("fill", seed=3, row_bytes=1 << 20, rank=0, cheap=True)
        d.call("raw_read", endpoint=endpoint, ops=[ReadOp(0, 0, 0, 4096, 0, 0)], repeat=1)  # wire-up: both agents active

        def cpu_s(pid: int) -> float:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        before = {proc.proc.pid: cpu_s(proc.proc.pid) for proc in (p, d)}
        time.sleep(3.0)
        used = {pid: (cpu_s(pid) - start) / 3.0 for pid, start in before.items()}
        assert all(share < 0.25 for share in used.values()), f"idle CPU share per process: {used}"
    finally:
        p.stop()
        d.stop()


def test_a_stalled_read_is_posted_again_on_a_fresh_endpoint():
    """A READ still running after `repost_after_s` is cancelled and posted once more on a fresh endpoint
    (reads.read_request / NixlTransport.repost). The stall is real: with UCX peer error handling an
    endpoint's first READ waits on a TCP handshake that the P process must answer, and P is stopped (SIGSTOP)
    until after the first attempt gave up. The bytes arrive exactly and P gets exactly one DONE."""
    import multiprocessing
    import signal
    import threading

    from kv_transfer.remap import ReadOp
    from tests.kv_transfer.rank_process import RankProcess, pool_pattern

    ctx = multiprocessing.get_context("spawn")
    peer_mode = {"error_handling": "peer", "repost_after_s": 1.5}
    p, d = RankProcess(ctx, "stall-P", 1 << 20, settings=peer_mode), RankProcess(ctx, "stall-D", 1 << 20,
                                                                                  settings=peer_mode)
    try:
        p.ready(120)
        d.ready(120)
        endpoint = p.call("fill", seed=5, row_bytes=4096, rank=0, cheap=True)
        d.call("zero", row_bytes=4096, rank=0)
        ops = [ReadOp(0, 3, 0, 4096, 10, 0), ReadOp(0, 7, 100, 2000, 11, 50)]
        os.kill(p.proc.pid, signal.SIGSTOP)
        resume = threading.Timer(2.5, os.kill, (p.proc.pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        out = d.call("read_plan", d_rank=0, ops=ops, endpoints={0: endpoint}, lease_id="L1", timeout=30)
        elapsed = time.monotonic() - started
        resume.join()
        assert out == {"results": [("DONE", 6096)], "reposted": 1}, out
        assert 1.5 <= elapsed < 30, elapsed
        src = np.resize(pool_pattern(5, 4099), 1 << 20)
        pool = np.frombuffer(d.call("pool"), dtype=np.uint8)
        assert np.array_equal(pool[10 * 4096:11 * 4096], src[3 * 4096:4 * 4096])
        assert np.array_equal(pool[11 * 4096 + 50:11 * 4096 + 2050], src[7 * 4096 + 100:7 * 4096 + 2100])
        notes = p.notifs(count=2, timeout=3)
        assert [m for _, m in notes] == [done_message("L1", "0.0", 1)], notes
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
        p.stop()
        d.stop()
