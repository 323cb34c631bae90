"""Shared harness of the real-NIXL tests: rank processes, a side-channel HTTP server, one P -> D request."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import uvicorn
from fastapi import FastAPI

from engine.layout import RowLayout, plan_layout
from engine.model.config import get_preset
from kv_transfer.cluster_auth import ControlGuard
from kv_transfer.lease import ExportKey, LeaseManager
from kv_transfer.params import KVTransferParams
from kv_transfer.remap import attention_source, naive_subblock_map
from kv_transfer.side_channel import InstanceMetadata, RankMetadata, side_channel_router
from kv_transfer.signing import ClusterSecret, lease_key
from serving.errors import install_error_handlers
from tests.conftest import free_port
from tests.kv_transfer.rank_process import RankProcess, pool_pattern

MODEL = "kimi-k3.1-mini"
POOL_BYTES = 8 << 20
SECRET = b"nixl-harness-cluster-secret-0123"
"""The harness's cluster secret: its side channel and leases check it, its D ranks sign with it."""


class FreeList:
    """The P pool's free rows, as the engine's allocator would keep them."""

    def __init__(self, num_rows: int) -> None:
        self.free = set(range(num_rows))
        self.idle = num_rows

    def take(self, n: int, rng: random.Random) -> list[int]:
        rows = rng.sample(sorted(self.free), n)
        self.free -= set(rows)
        return rows

    def give(self, rows) -> None:
        assert not set(rows) & self.free, "row freed twice"
        self.free |= set(rows)


@dataclass
class SideChannel:
    """uvicorn in a thread serving /kv/metadata for whatever instance `meta` holds now."""

    port: int = field(default_factory=free_port)
    meta: InstanceMetadata | None = None
    leases: LeaseManager | None = None

    def start(self) -> None:
        app = FastAPI()
        install_error_handlers(app)
        guard = ControlGuard(ClusterSecret(SECRET))
        app.include_router(side_channel_router(lambda: self.meta, guard, self._lease_proxy()))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "side channel did not start"

    def _lease_proxy(self):
        outer = self

        class Proxy:  # the current case's lease manager
            def abort(self, lid, reader):
                return outer.leases.abort_claimed(lid, reader)

            def claim(self, lid, reader):
                outer.leases.claim(lid, reader)
                return {}  # the harness's P ranks register their whole pools: no per-lease sections

        return Proxy()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Cluster:
    """Rank processes shared by every case of a module: P0, P1 and D0..D3."""

    def __init__(self, num_p: int = 2, num_d: int = 4) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ctx = ctx
        self.p = [RankProcess(ctx, f"P{i}", POOL_BYTES, cpu=i) for i in range(num_p)]
        self.d = [RankProcess(ctx, f"D{i}", POOL_BYTES, cpu=i + 1) for i in range(num_d)]
        for r in self.p + self.d:
            r.ready(300)
        self.side = SideChannel()
        self.side.start()
        self.cfg = get_preset(MODEL)

    def close(self) -> None:
        self.side.stop()
        for r in self.p + self.d:
            r.stop()


@dataclass
class Request:
    """One exported request: P rows under a lease, params as P returns them, D rows chosen."""

    p: RowLayout
    d: RowLayout
    num_tokens: int
    seeds: list[int]
    params: KVTransferParams
    p_attn: list[int]
    p_kda: list[int]
    d_attn: list[int]
    d_kda: list[int]
    free: FreeList
    leases: LeaseManager


def export(cl: Cluster, p_kw: dict, d_kw: dict, num_tokens: int, seed: int, ttl_s: float = 30.0,
           engine_id: str = "prefill-A", clock=time.time) -> Request:
    """Fill P pools with random bytes, publish metadata, lease the request's rows, zero D pools."""
    rng = random.Random(seed)
    p, d = plan_layout(cl.cfg, **p_kw), plan_layout(cl.cfg, **d_kw)
    seeds = [seed * 10 + r for r in range(p.tp_size)]
    eps = [cl.p[r].call("fill", seed=seeds[r], row_bytes=p.row_bytes, rank=r) for r in range(p.tp_size)]
    for r in range(d.tp_size):
        cl.d[r].call("zero", row_bytes=d.row_bytes, rank=r)
    free = FreeList(POOL_BYTES // p.row_bytes)
    p_attn = free.take(-(-num_tokens // p.block_size), rng)
    p_kda = free.take(p.kda_groups, rng)
    leases = LeaseManager(lambda lease, outcome: free.give(p_attn + p_kda), ttl_s=ttl_s, clock=clock,
                          secret=ClusterSecret(SECRET))
    lease = leases.create(ExportKey("req-1", 1))
    cl.side.leases = leases
    cl.side.meta = InstanceMetadata(
        engine_id=engine_id, model=MODEL, layout_fingerprint=p.fingerprint, tp_size=p.tp_size, block_size=p.block_size,
        subblock_tokens=p.subblock_tokens, row_bytes=p.row_bytes, num_rows=POOL_BYTES // p.row_bytes,
        kda_groups=p.kda_groups, ranks=[RankMetadata.from_endpoint(ep) for ep in eps])
    params = KVTransferParams(
        do_remote_prefill=True, remote_engine_id=engine_id, remote_request_id="req-1", remote_block_ids=[p_attn],
        remote_host="127.0.0.1", remote_port=cl.side.port, tp_size=p.tp_size, remote_num_tokens=num_tokens,
        block_size=p.block_size, subblock_tokens=p.subblock_tokens, layout_fingerprint=p.fingerprint,
        remote_kda_block_ids=p_kda, first_token_id=7, lease_id=lease.lease_id, lease_expiry=lease.expiry)
    d_rows = POOL_BYTES // d.row_bytes
    d_pick = rng.sample(range(d_rows), -(-num_tokens // d.block_size) + d.kda_groups)
    return Request(p, d, num_tokens, seeds, params, p_attn, p_kda, d_pick[: len(d_pick) - d.kda_groups],
                   d_pick[len(d_pick) - d.kda_groups:], free, leases)


def start_import(cl: Cluster, req: Request, d_kw: dict, params: dict | None = None, ranks=None, **extra) -> None:
    """D ranks import `req` as a decode node's would: side channel signed with the secret, DONEs with the lease's
    key."""
    notify_key = lease_key(ClusterSecret(SECRET), str(req.params.lease_id))
    for r in ranks if ranks is not None else range(req.d.tp_size):
        cl.d[r].send("import", model=MODEL, layout=d_kw, d_rank=r, params=params or req.params.to_wire(),
                     host="127.0.0.1", port=cl.side.port, d_attn=req.d_attn, d_kda=req.d_kda, secret=SECRET,
                     notify_key=notify_key, **extra)


def expected_d_pool(req: Request, d_rank: int) -> np.ndarray:
    """What D rank d_rank's pool must hold after the import (naive, sub-block and head at a time)."""
    p, d = req.p, req.d
    src = [pool_pattern(s, POOL_BYTES) for s in req.seeds]
    out = np.zeros(POOL_BYTES, dtype=np.uint8)
    a_src = src[attention_source(p, d, d_rank)]
    for d_off, p_off in naive_subblock_map(p, d, req.num_tokens, d_rank, req.p_attn, req.d_attn).items():
        out[d_off:d_off + p.subblock_bytes] = a_src[p_off:p_off + p.subblock_bytes]
    h0, h1 = d.global_heads(d_rank)
    hb = p.kda_head_bytes
    for g in range(d.kda_groups):
        for h in range(h0, h1):
            pr, ph = divmod(h, p.kda_heads_per_gpu)
            p_off = req.p_kda[g] * p.row_bytes + ph * hb
            d_off = req.d_kda[g] * d.row_bytes + (h - h0) * hb
            out[d_off:d_off + hb] = src[pr][p_off:p_off + hb]
    return out


def drain_notifications(cl: Cluster, req: Request, counts: dict[int, int], timeout: float = 10) -> int:
    """Collect each P rank's expected notifications and apply them to the leases; how many arrived."""
    n = 0
    for r, c in counts.items():
        for _src, msg in cl.p[r].notifs(c, timeout):
            req.leases.apply_message(msg)
            n += 1
    return n
