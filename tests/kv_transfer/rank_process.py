"""A real process hosting one rank's pool (numpy uint8) and NIXL agent, driven over a multiprocessing Pipe.

Used by tests/kv_transfer and benchmarks/transfer.py to run P and D ranks as separate processes.
`RankProcess(ctx, name, pool_bytes)` spawns one ('spawn' context); `call(cmd, **kw)` sends a command and
returns its answer (a child error is re-raised as RuntimeError carrying the child's traceback).
Commands: fill (random bytes from a seed), zero, import (the full decode path of kv_transfer.importer:
side channel over HTTP, checks, plan, READs with DONE notifications), raw_read (benchmark reads),
read_plan (reads.read_request over given ops: DONE notifications, reposting a stalled read),
digest, pool, notifs, send_notif (any message to a peer's agent, as an attacker with its metadata can),
expose / unexpose (a rank started with `per_lease`: one lease's rows registered, their metadata), tcp_fallback,
stop. `settings` are KVTransferSettings fields for the rank's agent (the
`kv` section of a node's settings).
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback

import numpy as np


def pool_pattern(seed: int, nbytes: int) -> np.ndarray:
    """The random contents a P rank's pool is filled with (the parent recomputes it to verify)."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _serve(conn, name: str, pool_bytes: int, ucx_tls: str, cpu: int | None, settings: dict,
           per_lease: bool = False) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu % os.cpu_count()})
    from engine.layout import plan_layout
    from engine.model.config import get_preset
    from kv_transfer.importer import import_request, plan_import
    from kv_transfer.nixl_agent import NixlTransport
    from kv_transfer.reads import read_request
    from kv_transfer.params import KVTransferParams
    from kv_transfer.remap import ReadPlan
    from kv_transfer.ucx_env import KVTransferSettings

    pool = np.zeros(pool_bytes, dtype=np.uint8)
    t = NixlTransport(name, pool, 1, KVTransferSettings(ucx_tls=ucx_tls, **settings), per_lease=per_lease)
    exposures: dict[int, object] = {}
    conn.send(("ok", name))
    inbox: list[tuple[str, bytes]] = []
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "stop":
                t.close()
                conn.send(("ok", None))
                return
            if cmd == "fill":  # random contents from a seed (or a cheap pattern); set row size
                period = pool_bytes if not kw.get("cheap") else 4099  # cheap: a random period-4099 tile
                pool[:] = np.resize(pool_pattern(kw["seed"], period), pool_bytes)
                t.set_row_bytes(kw["row_bytes"])
                out = t.endpoint(kw["rank"])
            elif cmd == "zero":
                pool[:] = 0
                t.set_row_bytes(kw["row_bytes"])
                out = t.endpoint(kw["rank"])
            elif cmd == "import":  # the decode path: side channel over HTTP, checks, plan, READs, notify
                from kv_transfer.cluster_auth import ClusterAuth  # the HTTP stack only where it is used
                from kv_transfer.side_channel import fetch_metadata
                from kv_transfer.signing import ClusterSecret

                cfg = get_preset(kw["model"])
                d_layout = plan_layout(cfg, **kw["layout"])
                t.set_row_bytes(d_layout.row_bytes)
                meta = fetch_metadata(kw["host"], kw["port"], ClusterAuth(ClusterSecret(kw["secret"])))
                params = KVTransferParams.from_wire(kw["params"])
                if kw.get("die_after_post"):
                    plan = plan_import(cfg, d_layout, params, meta, kw["d_attn"], kw["d_kda"])
                    eps = meta.endpoints()
                    for p_rank, rops in plan.by_source(kw["d_rank"]).items():
                        t.post_read(eps[p_rank], rops, b"")
                    os._exit(3)  # reader crashes mid-request: no completion, no notification
                res = import_request(t, cfg, d_layout, kw["d_rank"], params, meta, kw["d_attn"], kw["d_kda"], 30,
                                     notify_key=kw["notify_key"])
                out = [(r.state.value, r.bytes, r.descriptors, r.backend_descriptors, r.wall_s) for r in res]
            elif cmd == "raw_read":  # benchmark: ops against one peer, repeated; per read:
                out = []  # (wall s, backend descriptors, backend transfer s, CPU s of this process)
                for _ in range(kw["repeat"]):
                    c0 = time.process_time()
                    h = t.post_read(kw["endpoint"], kw["ops"], b"")
                    res = t.wait(h, 120)
                    cpu = time.process_time() - c0
                    out.append((res.wall_s, res.backend_descriptors, res.backend_xfer_s, cpu))
                    t.release(h)
            elif cmd == "read_plan":  # read_request: one READ per P rank in `endpoints`, DONE notifications
                res = read_request(t, kw["d_rank"], ReadPlan({kw["d_rank"]: kw["ops"]}), kw["endpoints"],
                                   kw["lease_id"], kw.get("timeout"), kw.get("notify_key", b""))
                out = {"results": [(r.state.value, r.bytes) for r in res], "reposted": t.reads_reposted}
            elif cmd == "read_while_busy":  # two requests' READs: the second posted while the first still runs
                from kv_transfer.reads import PendingReads

                first, second = (PendingReads(t, 0, ReadPlan({0: ops}), {0: ep}, lease, 30)
                                 for ep, ops, lease in kw["requests"])
                waited = len(second._unposted)  # not posted yet: its peer's entry is busy
                try:
                    while not (first.poll() & second.poll()):
                        time.sleep(0.001)
                    out = {"waited": waited, "results": [[(r.state.value, r.bytes) for r in reads.results()]
                                                         for reads in (first, second)]}
                finally:
                    first.close()
                    second.close()
            elif cmd == "digest":  # sha256 over the listed (offset, length) ranges, in order
                hsh = hashlib.sha256()
                for off, length in kw["ranges"]:
                    hsh.update(memoryview(pool)[off:off + length])
                out = hsh.hexdigest()
            elif cmd == "pool":
                out = bytes(pool)
            elif cmd == "notifs":  # wait until `count` notifications arrived (bounded), return them
                deadline = time.monotonic() + kw.get("timeout", 10)
                while len(inbox) < kw["count"] and time.monotonic() < deadline:
                    inbox.extend(t.notifications())
                    time.sleep(0.002)
                out, inbox = inbox, []
            elif cmd == "expose":  # per-lease exposure: register `rows`, answer (id, the metadata addressing them)
                exposure = t.expose(kw["rows"])
                exposures[id(exposure)] = exposure
                out = (id(exposure), exposure.metadata)
            elif cmd == "unexpose":
                t.unexpose(exposures.pop(kw["exposure"]))
                out = None
            elif cmd == "send_notif":  # any agent that loaded a peer's metadata can notify it
                t.send_notif(t.add_peer(kw["endpoint"]), kw["message"])
                out = None
            elif cmd == "tcp_fallback":
                out = (t.tcp_fallback, t.fallback_reason, t.ucx_tls)
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001 - report to the parent
            conn.send(("err", traceback.format_exc()))


class RankProcess:
    """Parent-side handle of one rank process."""

    def __init__(self, ctx, name: str, pool_bytes: int, ucx_tls: str = "auto", cpu: int | None = None,
                 settings: dict | None = None, per_lease: bool = False) -> None:
        self.conn, child = ctx.Pipe()
        self.name = name
        self.proc = ctx.Process(target=_serve, args=(child, name, pool_bytes, ucx_tls, cpu, settings or {}, per_lease),
                                daemon=True)
        self.proc.start()

    def ready(self, timeout: float = 60) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not start")
        self.conn.recv()

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout: float = 60):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def call(self, cmd: str, timeout: float = 180, **kw):
        self.send(cmd, **kw)
        return self.recv(timeout)

    def notifs(self, count: int, timeout: float) -> list[tuple[str, bytes]]:
        """Notifications this (P) rank received, waiting up to `timeout` for `count` of them."""
        self.send("notifs", count=count, timeout=timeout)
        return self.recv(timeout + 30)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except (RuntimeError, TimeoutError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
