"""NIXL (UCX backend) implementation of kv_transfer.transport.KVTransport, and how nodes use it.

Prefill node (export), per rank:
  1. `t = NixlTransport(f"{engine_id}-p{rank}", pool, row_bytes, settings)` registers the whole pool once
     (a numpy uint8 array or a torch uint8 tensor; CPU pools as DRAM, CUDA pools as VRAM).
  2. Serve `t.endpoint(rank)` of every rank on the side channel: mount
     `kv_transfer.side_channel.side_channel_router(get_metadata, leases)` in the node's FastAPI app
     (GET /kv/metadata, POST /kv/leases/{id}/heartbeat, POST /kv/leases/{id}/abort), or an equivalent
     router serving the same facts (serving/side_channel.py does, under /kv_transfer).
  3. When a request finishes prefill, keep its rows under `leases.create(rows)` (kv_transfer.lease) and
     return kv_transfer_params with remote_block_ids, remote_kda_block_ids, block_size, layout_fingerprint,
     lease_id, lease_expiry, first_token_id.
  4. In the node loop: `pump_notifications([t...], leases)` applies D's DONE / HB / ABORT messages (rows are
     freed through the lease's callback) and `leases.expire()` frees what nobody read.
Decode node (import), per request:
  1. `meta = side_channel.fetch_metadata(host, port)` (cache per remote engine id) and
     `check_readable(params, ...)` (kv_transfer.params): unknown engine, wrong fingerprint, bad rows or an
     expired lease fail here, before any memory is touched.
  2. Allocate D rows, `plan = remap.plan_reads(p_layout, d_layout, num_tokens, ...)`.
  3. Per D rank: `read_request(t, d_rank, plan, endpoints, lease_id)` adds peers (once), posts ONE READ per
     source P rank with one descriptor per merged op and a DONE notification, polls to completion.
  Steps 1-3 in one call: `kv_transfer.importer.import_request(t, cfg, d_layout, d_rank, params, meta, ...)`.
UCX transports: `KVTransferSettings.ucx_tls` (env PDC_KV_UCX_TLS) is written to UCX_TLS before the agent
starts, so UCX never picks transports silently; `detect_tcp_fallback` flags a configuration where RMA can only
run over TCP (logged as a warning; `tcp_fallback` feeds the `pdcluster_node_ucx_tcp_fallback` gauge).
One UCX context per process: every NixlTransport in a process shares the first one's UCX_TLS.
UCX peer-failure handling (`KVTransferSettings.error_handling`): on a host without an RDMA device the agents'
endpoints run without it, so wire-up and notifications go over shared memory and a first READ needs no TCP
handshake with the remote process; with an RDMA device (peers on other hosts) NIXL's `peer` mode stays.
A read still running after `repost_after_s` is cancelled and posted once more on a fresh endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from pydantic_settings import BaseSettings, SettingsConfigDict

from kv_transfer.lease import LeaseManager, done_message
from kv_transfer.remap import ReadOp, ReadPlan
from kv_transfer.transport import RankEndpoint, ReadResult, TransferError, TransferState

log = logging.getLogger(__name__)

RDMA_TLS = "rc_x,rc,ud_x,dc_x"
GPU_TLS = "cuda_ipc,cuda_copy"
HOST_TLS = "sm,cma,self,tcp"
DEFAULT_UCX_TLS = "auto"
"""`auto` resolves to an explicit list from the hardware present (`resolve_ucx_tls`): RDMA verbs when an
InfiniBand/RoCE device exists, CUDA IPC/copy for GPU pools, shared memory / CMA for same-host peers; tcp
stays for wire-up and notifications (RMA over tcp is what detect_tcp_fallback reports)."""
FAST_RMA_TLS = ("rc", "rc_x", "rc_v", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_x", "ud_v", "ib",
                "cuda_ipc", "sm", "cma", "posix", "sysv", "xpmem", "knem", "shm", "all")


class KVTransferSettings(BaseSettings):
    """Transfer settings of one node (env prefix PDC_KV_)."""

    model_config = SettingsConfigDict(env_prefix="PDC_KV_")
    ucx_tls: str = DEFAULT_UCX_TLS
    capture_telemetry: bool = True
    num_threads: int = 0
    """UCX worker threads (0: NIXL default)."""
    progress_delay_us: int = 2000
    """How long NIXL's UCX progress thread waits for worker events between progress passes. NIXL's Python
    API fixes it at 0, a busy loop (measured: ~95% of a core per idle rank process, so an idle 5-rank cluster
    on 2 cores starved its own prefill 10x). With a delay the thread sleeps in poll() on the workers' event
    fds, waking at once on traffic (wire-up requests from decode peers while a prefill step runs)."""
    error_handling: str = "auto"
    """UCX peer-failure handling of the agent's endpoints (NIXL's `ucx_error_handling_mode`): `peer`, `none`,
    or `auto`. `peer` (NIXL's default) excludes shared-memory transports from the endpoint, so every endpoint
    gets a TCP lane for its active messages (wire-up, notifications, keepalive) and its first READ waits on a
    TCP handshake that the remote worker must progress; `none` sends those over shared memory and connects to
    the remote interface at once. `auto`: `none` when the peers are on this host (CMA or shared memory reads
    fail by themselves if a peer process is gone, and P's leases expire) on a host without an RDMA device,
    `peer` where one is present (peers on other hosts)."""
    poll_timeout_s: float = 30.0
    repost_after_s: float = 10.0
    """A read still running after this long is cancelled and posted once more on a fresh endpoint to the same
    peer (NixlTransport.repost), within poll_timeout_s. A local CMA read of a whole request takes milliseconds;
    one stalled for seconds is waiting on an endpoint, not on bytes."""
    lease_ttl_s: float = 30.0


SPIN_S = 0.002
POLL_SLEEP_S = 0.0005

NIXL_MODULES = ("nixl_cu12", "nixl_cu13")
"""NIXL's wheels by CUDA major; the `nixl` meta package may pick one that does not match the machine, so the
wheel is imported by name: PDC_KV_NIXL_MODULE if set, else the first of these that is installed."""


def nixl_api() -> Any:
    """NIXL's Python API module (`<wheel>._api`), imported on first use (heavy)."""
    import importlib  # noqa: PLC0415

    wanted = os.environ.get("PDC_KV_NIXL_MODULE")
    errors = []
    for name in ([wanted] if wanted else NIXL_MODULES):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("no NIXL wheel could be imported (" + "; ".join(errors) + ")")


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """While NIXL (`api`, from nixl_api) builds an agent, its config class keeps `pthrDelay` at `delay_us` (the
    Python API writes 0)."""
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's field name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    api.nixlBind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        api.nixlBind.nixlAgentConfig = base


def rdma_present(infiniband_dir: str = "/sys/class/infiniband") -> bool:
    ib = Path(infiniband_dir)
    return ib.is_dir() and any(ib.iterdir())


def resolve_error_handling(setting: str, infiniband_dir: str = "/sys/class/infiniband") -> str:
    """NIXL's `ucx_error_handling_mode` for `setting` (see KVTransferSettings.error_handling)."""
    if setting == "auto":
        return "peer" if rdma_present(infiniband_dir) else "none"
    if setting not in ("none", "peer"):
        raise ValueError(f"error_handling must be auto, none or peer, got {setting!r}")
    return setting


def nvidia_gpu_present(driver_dir: str = "/proc/driver/nvidia/gpus") -> bool:
    d = Path(driver_dir)
    return d.is_dir() and any(d.iterdir())


def resolve_ucx_tls(setting: str, mem_type: str, infiniband_dir: str = "/sys/class/infiniband",
                    gpu_present: bool | None = None) -> str:
    """The explicit UCX_TLS list for `setting` (`auto` or a literal list, returned unchanged). CUDA transports
    are listed for VRAM pools and whenever an NVIDIA GPU is visible: NIXL 1.5.1 refuses to create its UCX
    backend on a GPU machine whose UCX_TLS lacks cuda_copy, even for a DRAM pool (seen on an H200 host)."""
    if setting != "auto":
        return setting
    parts = [RDMA_TLS] if rdma_present(infiniband_dir) else []
    if mem_type == "VRAM" or (nvidia_gpu_present() if gpu_present is None else gpu_present):
        parts.append(GPU_TLS)
    return ",".join(parts + [HOST_TLS])


def detect_tcp_fallback(ucx_tls: str, peer_is_local: bool, infiniband_dir: str = "/sys/class/infiniband",
                        ptrace_scope_file: str = "/proc/sys/kernel/yama/ptrace_scope") -> str | None:
    """Why RMA would run over TCP with this transport list, or None. Local peers need shared memory or CMA
    (CMA needs ptrace_scope <= 1); remote peers need an InfiniBand/RoCE device."""
    tls = [t.strip() for t in ucx_tls.split(",") if t.strip()]
    if tls and tls[0].startswith("^"):
        excluded = {tls[0][1:], *tls[1:]}
        tls = [t for t in FAST_RMA_TLS + ("tcp",) if t not in excluded]
    has_ib = rdma_present(infiniband_dir)
    if peer_is_local:
        scope = Path(ptrace_scope_file)
        cma_ok = not scope.exists() or scope.read_text().strip() in ("0", "1")
        local = {"sm", "posix", "sysv", "xpmem", "knem", "shm", "all", "cuda_ipc"} | ({"cma"} if cma_ok else set())
        if any(t in local for t in tls) or (has_ib and any(t.startswith(("rc", "dc", "ud", "ib")) for t in tls)):
            return None
        return f"UCX_TLS={ucx_tls}: no shared-memory/CMA transport usable between local processes"
    if has_ib and any(t.startswith(("rc", "dc", "ud", "ib")) or t == "all" for t in tls):
        return None
    return f"UCX_TLS={ucx_tls}: no RDMA device/transport for a remote peer (InfiniBand dir {infiniband_dir})"


def _buffer_addr(pool: Any) -> tuple[int, int, str, int]:
    """(address, bytes, mem type, device id) of a numpy array or torch tensor pool."""
    if isinstance(pool, np.ndarray):
        if not pool.flags["C_CONTIGUOUS"]:
            raise ValueError("pool array must be contiguous")
        return pool.ctypes.data, pool.nbytes, "DRAM", 0
    if hasattr(pool, "data_ptr"):
        is_cuda = bool(getattr(pool, "is_cuda", False))
        dev = pool.device.index or 0 if is_cuda else 0
        return pool.data_ptr(), pool.numel() * pool.element_size(), "VRAM" if is_cuda else "DRAM", dev
    raise TypeError(f"pool must be a numpy array or a torch tensor, got {type(pool).__name__}")


@dataclass
class _Handle:
    xfer: Any
    peer: RankEndpoint
    ops: tuple[ReadOp, ...]
    notif: bytes
    t_start: float
    post_s: float
    state: TransferState = TransferState.PROC
    wall_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(op.length for op in self.ops)

    @property
    def descriptors(self) -> int:
        return len(self.ops)


class NixlTransport:
    """One rank's NIXL agent with its pool registered once (see the module docstring)."""

    def __init__(self, agent_name: str, pool: Any, row_bytes: int, settings: KVTransferSettings | None = None,
                 peer_is_local: bool = True) -> None:
        self.settings = settings or KVTransferSettings()
        self.base_addr, self.pool_bytes, self.mem_type, self.device_id = _buffer_addr(pool)
        self.ucx_tls = resolve_ucx_tls(self.settings.ucx_tls, self.mem_type)
        os.environ["UCX_TLS"] = self.ucx_tls  # before UCX starts: never let UCX choose silently
        api = nixl_api()

        log.info("NIXL agent %s: UCX_TLS=%s", agent_name, self.ucx_tls)
        self.fallback_reason = detect_tcp_fallback(self.ucx_tls, peer_is_local)
        if self.fallback_reason:
            log.warning("KV transfer will run over TCP: %s", self.fallback_reason)
        self.agent_name = agent_name
        conf = api.nixl_agent_config(backends=[], capture_telemetry=self.settings.capture_telemetry)
        with _progress_delay(api, self.settings.progress_delay_us):
            self._agent = api.nixl_agent(agent_name, conf)
            self._agent.create_backend("UCX", self._backend_params())
        self._pool = pool  # keep the memory alive while registered
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        self.row_bytes = row_bytes
        self.num_rows = self.pool_bytes // row_bytes
        self._reg = self._agent.register_memory([(self.base_addr, self.pool_bytes, self.device_id, "")], self.mem_type)
        self._peers: dict[str, str] = {}
        self.reads_failed = 0
        self.reads_reposted = 0

    def _backend_params(self) -> dict[str, str]:
        params = {"ucx_error_handling_mode": resolve_error_handling(self.settings.error_handling)}
        if self.settings.num_threads > 0:
            params["num_threads"] = str(self.settings.num_threads)
        return params

    def set_row_bytes(self, row_bytes: int) -> None:
        """Re-slice the same registered pool into rows of another size (re-planning; no re-registration)."""
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        self.row_bytes, self.num_rows = row_bytes, self.pool_bytes // row_bytes

    @property
    def tcp_fallback(self) -> bool:
        return self.fallback_reason is not None

    def endpoint(self, rank: int) -> RankEndpoint:
        return RankEndpoint(rank, self.agent_name, self._agent.get_agent_metadata(), self.base_addr,
                            self.pool_bytes, self.row_bytes, self.num_rows, self.mem_type, self.device_id)

    def add_peer(self, peer: RankEndpoint) -> str:
        """Load a remote agent's metadata once; its name."""
        if peer.agent_name not in self._peers:
            name = self._agent.add_remote_agent(peer.agent_metadata)
            self._peers[peer.agent_name] = name.decode() if isinstance(name, bytes) else name
        return self._peers[peer.agent_name]

    def _descs(self, peer: RankEndpoint, ops: Sequence[ReadOp]) -> tuple[np.ndarray, np.ndarray]:
        local = np.empty((len(ops), 3), dtype=np.uint64)
        remote = np.empty((len(ops), 3), dtype=np.uint64)
        for i, op in enumerate(ops):
            p_off = op.p_row * peer.row_bytes + op.p_offset
            d_off = op.d_row * self.row_bytes + op.d_offset
            if op.length <= 0 or p_off < 0 or d_off < 0 or p_off + op.length > peer.pool_bytes \
                    or d_off + op.length > self.pool_bytes:
                raise TransferError(f"read {op} falls outside the pools ({peer.pool_bytes} / {self.pool_bytes} bytes)")
            remote[i] = (peer.base_addr + p_off, op.length, peer.device_id)
            local[i] = (self.base_addr + d_off, op.length, self.device_id)
        return local, remote

    def post_read(self, peer: RankEndpoint, ops: Sequence[ReadOp], notif: bytes = b"") -> _Handle:
        """Post ONE READ from `peer` carrying one descriptor per op; bounds are checked first."""
        if not ops:
            raise TransferError("empty read")
        if any(op.p_rank != peer.rank for op in ops):
            raise TransferError(f"ops name P ranks other than {peer.rank}")
        local, remote = self._descs(peer, ops)
        name = self.add_peer(peer)
        t0 = time.perf_counter()
        ldl = self._agent.get_xfer_descs(local, self.mem_type)
        rdl = self._agent.get_xfer_descs(remote, peer.mem_type)
        xfer = self._agent.initialize_xfer("READ", ldl, rdl, name, notif)
        state = self._agent.transfer(xfer)
        post_s = time.perf_counter() - t0
        h = _Handle(xfer, peer, tuple(ops), notif, t0, post_s)
        self._set_state(h, state)
        return h

    def _set_state(self, h: _Handle, state: str) -> None:
        if state == "ERR":
            self.reads_failed += 1
            h.state = TransferState.ERR
        elif state == "DONE":
            h.state = TransferState.DONE
        if h.state is not TransferState.PROC and not h.wall_s:
            h.wall_s = time.perf_counter() - h.t_start

    def poll(self, handle: _Handle) -> TransferState:
        if handle.state is TransferState.PROC:
            self._set_state(handle, self._agent.check_xfer_state(handle.xfer))
        return handle.state

    def wait(self, handle: _Handle, timeout_s: float | None = None) -> ReadResult:
        """Poll until DONE/ERR or the timeout (TransferError). Polls back to back for the first SPIN_S (a CMA
        or RDMA read of a few MB is done by then), then every POLL_SLEEP_S: on two cores a reader spinning for
        seconds takes a core from the ranks it waits on."""
        timeout_s = timeout_s or self.settings.poll_timeout_s
        started = time.monotonic()
        while self.poll(handle) is TransferState.PROC:
            waited = time.monotonic() - started
            if waited > timeout_s:
                raise TransferError(f"read from {handle.peer.agent_name} ({handle.descriptors} descriptors, "
                                    f"{handle.nbytes} B) still running after {timeout_s:.1f} s")
            if waited > SPIN_S:
                time.sleep(POLL_SLEEP_S)
        return self.result(handle)

    def repost(self, handle: _Handle) -> _Handle:
        """Cancel a read that is still running and post it again on a fresh endpoint to the same peer (its
        metadata loaded anew). Reads are idempotent and the DONE notification goes out only when a read
        completes, so P sees one DONE either way."""
        try:
            self.release(handle)
        except Exception:  # noqa: BLE001 - NIXL could not cancel it; the new read does not depend on it
            log.warning("could not cancel the stalled read from %s", handle.peer.agent_name)
        name = self._peers.pop(handle.peer.agent_name, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - reloading the metadata below is what matters
                log.warning("could not drop the endpoint to %s", handle.peer.agent_name)
        self.reads_reposted += 1
        return self.post_read(handle.peer, handle.ops, handle.notif)

    def result(self, handle: _Handle) -> ReadResult:
        backend_descs = xfer_s = None
        if self.settings.capture_telemetry and handle.state is TransferState.DONE:
            try:
                tele = self._agent.get_xfer_telemetry(handle.xfer)
                backend_descs, xfer_s = int(tele.descCount), int(tele.xferDuration) / 1e6
            except Exception:  # noqa: BLE001 - telemetry is optional per backend
                pass
        return ReadResult(handle.state, handle.nbytes, handle.descriptors, backend_descs, handle.post_s, handle.wall_s,
                          xfer_s)

    def release(self, handle: _Handle) -> None:
        self._agent.release_xfer_handle(handle.xfer)

    def send_notif(self, peer_agent: str, msg: bytes) -> None:
        self._agent.send_notif(peer_agent, msg)

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for src, msgs in self._agent.get_new_notifs().items():
            src = src.decode() if isinstance(src, bytes) else src
            out.extend((src, m) for m in msgs)
        return out

    def close(self) -> None:
        for name in list(self._peers.values()):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - peer may be gone already
                pass
        self._peers.clear()
        self._agent.deregister_memory(self._reg)


def pump_notifications(transports: Sequence[NixlTransport], leases: LeaseManager) -> int:
    """Prefill side: apply every pending reader notification to the leases; how many were applied."""
    n = 0
    for t in transports:
        for src, msg in t.notifications():
            try:
                leases.apply_message(msg)
                n += 1
            except ValueError:
                log.warning("ignoring malformed notification %r from %s", msg, src)
    return n


def read_request(transport: NixlTransport, d_rank: int, plan: ReadPlan, endpoints: dict[int, RankEndpoint],
                 lease_id: str, timeout_s: float | None = None) -> list[ReadResult]:
    """Decode side, one D rank: one READ per source P rank (each notifies P with a DONE for the lease),
    polled to completion. A read still running after `settings.repost_after_s` is posted once more on a fresh
    endpoint (NixlTransport.repost). Raises TransferError on ERR or when `timeout_s` (default
    settings.poll_timeout_s) runs out."""
    total = len(plan.consumers())
    deadline = time.monotonic() + (timeout_s or transport.settings.poll_timeout_s)

    def left_s() -> float:
        return deadline - time.monotonic()

    handles = []
    for p_rank, ops in plan.by_source(d_rank).items():
        notif = done_message(lease_id, f"{d_rank}.{p_rank}", total)
        handles.append(transport.post_read(endpoints[p_rank], ops, notif))
    results = []
    try:
        for i, h in enumerate(handles):
            try:
                res = transport.wait(h, max(0.001, min(transport.settings.repost_after_s, left_s())))
            except TransferError as exc:
                if left_s() <= 0:
                    raise
                log.warning("%s; posting it again on a fresh endpoint", exc)
                handles[i] = h = transport.repost(h)
                res = transport.wait(h, max(0.001, left_s()))
            if res.state is not TransferState.DONE:
                raise TransferError(f"read from {h.peer.agent_name} failed")
            results.append(res)
    finally:
        for h in handles:
            try:
                transport.release(h)
            except Exception:  # noqa: BLE001 - NIXL keeps a handle it cannot cancel yet
                log.warning("could not release a read handle from %s", h.peer.agent_name)
    return results
