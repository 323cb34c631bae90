"""NIXL (UCX backend) implementation of kv_transfer.transport.KVTransport: one rank's agent over its row pool,
READs posted with one descriptor per merged row range, polled, reposted or released.

Prefill side, per rank: `NixlTransport(f"{engine_id}-p{rank}", pool, row_bytes, settings, per_lease=True)` (a
numpy uint8 array or a torch uint8 tensor; CPU pools as DRAM, CUDA pools as VRAM) registers nothing up front:
`expose(rows)` registers one export's rows (adjacent rows as one region) and returns the partial metadata of just
those regions, which only the decode node that claims the lease receives; `unexpose` deregisters them when the
lease ends. Its `endpoint(rank)`, served on the side channel (kv_transfer.side_channel), then carries the agent's
connection info and no memory, so holding it addresses no row. NIXL refuses, on the reader's side, a READ outside
the regions it loaded; whether the transport refuses it too depends on the transport (RDMA: the rows' keys die
with their registration; TCP and shared memory: see docs/NODE_SURFACE.md). `per_lease=False` registers the whole
pool once (the transfer benchmarks and tests of the READ path). `notifications()` yields the readers' DONE
messages that end the node's leases (kv_transfer.lease).
Decode side, per request and D rank: kv_transfer.importer plans the reads and kv_transfer.reads posts them (one
READ per source P rank carrying a DONE notification for the lease) and polls them without blocking; a READ loads
its lease's sections (`RankEndpoint.sections`) into the peer's entry first (at most MAX_SECTIONS per peer: past
that, the entry is dropped and reloaded when no READ from that peer runs). NIXL keeps a peer's loaded regions in
one sorted list and finds a descriptor's region by binary search, assuming regions do not overlap; but the rows
of an ended lease are exposed again for later ones, as regions that overlap those still loaded from earlier
leases (or, with P's prefix cache, from a live lease sharing a block), so a READ inside its own lease's region can
be refused ("no specified or potential backend had the required registrations"). A refused READ whose peer
entry holds other leases' sections is therefore posted once more on the entry loaded afresh with this lease's
sections alone, when no READ from that peer runs (`PeerBusy` otherwise: kv_transfer/reads.py posts it later); a
refusal on a fresh entry is final (rows outside the lease). A read still running after
`repost_after_s` is cancelled and posted once more on a fresh endpoint (`repost`). A decode rank
(`per_lease=True, register_pool=True`) has its whole pool registered as its READs' target and, like a prefill
rank, serves readers only what `expose` names: the rows of a stream it moves out on drain (decode_node/moves.py).
UCX configuration: kv_transfer.ucx_env.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kv_transfer.remap import ReadOp
from kv_transfer.transport import Exposure, PeerBusy, RankEndpoint, ReadResult, TransferError, TransferState
from kv_transfer.ucx_env import (
    KVTransferSettings,
    detect_tcp_fallback,
    nixl_api,
    progress_delay,
    resolve_cuda_ipc_get_zcopy,
    resolve_error_handling,
    resolve_ucx_tls,
)

log = logging.getLogger(__name__)

SPIN_S = 0.002
POLL_SLEEP_S = 0.0005
MAX_SECTIONS = 256
"""Lease sections a reader keeps loaded per peer before it drops the peer's entry (when idle) and starts afresh."""

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
                 peer_is_local: bool = True, per_lease: bool = False, register_pool: bool | None = None) -> None:
        self.settings = settings or KVTransferSettings()
        self.base_addr, self.pool_bytes, self.mem_type, self.device_id = _buffer_addr(pool)
        self.ucx_tls = resolve_ucx_tls(self.settings.ucx_tls, self.mem_type)
        os.environ["UCX_TLS"] = self.ucx_tls  # before UCX starts: never let UCX choose silently
        get_zcopy = resolve_cuda_ipc_get_zcopy(self.settings.cuda_ipc_get_zcopy, self.mem_type)
        if get_zcopy is not None:  # VRAM READs between processes on one GPU: cuda_ipc, not host staging
            os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = get_zcopy
        api = nixl_api(self.settings.nixl_module)

        log.info("NIXL agent %s: UCX_TLS=%s", agent_name, self.ucx_tls)
        self.fallback_reason = detect_tcp_fallback(self.ucx_tls, peer_is_local)
        if self.fallback_reason:
            log.warning("KV transfer will run over TCP: %s", self.fallback_reason)
        self.agent_name = agent_name
        conf = api.nixl_agent_config(backends=[], capture_telemetry=self.settings.capture_telemetry)
        with progress_delay(api, self.settings.progress_delay_us):
            self._agent = api.nixl_agent(agent_name, conf)
            self._agent.create_backend("UCX", self._backend_params())
        self._pool = pool  # keep the memory alive while registered
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        self.row_bytes = row_bytes
        self.num_rows = self.pool_bytes // row_bytes
        self._api = api
        self.per_lease = per_lease
        """Readers address only what `expose` names (the endpoint carries the connection, no memory)."""
        if register_pool is None:
            register_pool = not per_lease
        self._reg = None if not register_pool else self._agent.register_memory(
            [(self.base_addr, self.pool_bytes, self.device_id, "")], self.mem_type)
        self._peers: dict[str, str] = {}
        self._sections: dict[str, set[bytes]] = {}
        """Peer agent name -> the lease sections loaded into its entry."""
        self._inflight: dict[str, set[int]] = {}
        """Peer agent name -> ids of this transport's READs from it still running (repost keeps their endpoint)."""
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

    def _empty_regs(self) -> Any:
        bind = self._api.nixlBind
        return bind.nixlRegDList(bind.VRAM_SEG if self.mem_type == "VRAM" else bind.DRAM_SEG)

    def endpoint(self, rank: int) -> RankEndpoint:
        """This agent as readers address it: with per-lease exposure its connection info only (no memory)."""
        metadata = self._agent.get_partial_agent_metadata(self._empty_regs(), True, ["UCX"]) if self.per_lease \
            else self._agent.get_agent_metadata()
        return RankEndpoint(rank, self.agent_name, metadata, self.base_addr, self.pool_bytes, self.row_bytes,
                            self.num_rows, self.mem_type, self.device_id)

    def expose(self, rows: Sequence[int]) -> Exposure:
        """Register `rows` (adjacent rows as one region) and return the metadata that addresses them alone."""
        if not rows or any(not 0 <= r < self.num_rows for r in rows):
            raise TransferError(f"rows {sorted(rows)[:8]} are not rows of this pool (0..{self.num_rows - 1})")
        regions: list[list[int]] = []
        for row in sorted(set(rows)):
            if regions and regions[-1][0] + regions[-1][1] == row * self.row_bytes:
                regions[-1][1] += self.row_bytes
            else:
                regions.append([row * self.row_bytes, self.row_bytes])
        handle = self._agent.register_memory(
            [(self.base_addr + off, length, self.device_id, "") for off, length in regions], self.mem_type)
        try:
            metadata = self._agent.get_partial_agent_metadata(handle, False, ["UCX"])
        except BaseException:
            self._agent.deregister_memory(handle)
            raise
        return Exposure(handle, metadata, len(regions))

    def unexpose(self, exposure: Exposure) -> None:
        self._agent.deregister_memory(exposure.handle)

    def add_peer(self, peer: RankEndpoint) -> str:
        """Load a remote agent's metadata once, then the lease sections `peer` carries (once each); its name."""
        loaded = self._sections.get(peer.agent_name, set())
        if peer.sections and peer.sections not in loaded and len(loaded) >= MAX_SECTIONS \
                and not self._inflight.get(peer.agent_name):
            self._drop_peer(peer.agent_name)  # idle: start its entry afresh instead of growing it
        if peer.agent_name not in self._peers:
            name = self._agent.add_remote_agent(peer.agent_metadata)
            self._peers[peer.agent_name] = name.decode() if isinstance(name, bytes) else name
            self._sections[peer.agent_name] = set()
        if peer.sections and peer.sections not in self._sections[peer.agent_name]:
            self._agent.add_remote_agent(peer.sections)
            self._sections[peer.agent_name].add(peer.sections)
        return self._peers[peer.agent_name]

    def _drop_peer(self, agent_name: str) -> None:
        """Forget a remote agent's entry (its metadata and sections are loaded anew on next use)."""
        name = self._peers.pop(agent_name, None)
        self._sections.pop(agent_name, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - reloading the metadata is what matters
                log.warning("could not drop the endpoint to %s", agent_name)

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
        t0 = time.perf_counter()
        ldl = self._agent.get_xfer_descs(local, self.mem_type)
        rdl = self._agent.get_xfer_descs(remote, peer.mem_type)
        xfer = self._initialize(peer, ldl, rdl, notif)
        state = self._agent.transfer(xfer)
        post_s = time.perf_counter() - t0
        h = _Handle(xfer, peer, tuple(ops), notif, t0, post_s)
        self._inflight.setdefault(peer.agent_name, set()).add(id(h))
        self._set_state(h, state)
        return h

    def _initialize(self, peer: RankEndpoint, ldl: Any, rdl: Any, notif: bytes) -> Any:
        """The READ's transfer handle; a refusal on an entry that holds other leases' sections is retried on the
        entry loaded afresh (see the module docstring: PeerBusy while READs from the peer run)."""
        name = self.add_peer(peer)
        try:
            return self._agent.initialize_xfer("READ", ldl, rdl, name, notif)
        except Exception as exc:  # noqa: BLE001 - NIXL's refusal (e.g. rows its loaded metadata does not cover)
            refusal = exc
        if self._sections.get(peer.agent_name, set()) - {peer.sections}:
            if self._inflight.get(peer.agent_name):
                raise PeerBusy(f"the READ from {peer.agent_name} waits for the running ones to reload its entry")
            log.info("READ from %s refused on an entry holding %d lease(s)' sections: reloading it", peer.agent_name,
                     len(self._sections[peer.agent_name]))
            self._drop_peer(peer.agent_name)
            name = self.add_peer(peer)
            try:
                return self._agent.initialize_xfer("READ", ldl, rdl, name, notif)
            except Exception as exc:  # noqa: BLE001 - refused on a fresh entry: rows outside the lease
                refusal = exc
        raise TransferError(f"NIXL refused the READ from {peer.agent_name}: {type(refusal).__name__}: {refusal}") \
            from refusal

    def _set_state(self, h: _Handle, state: str) -> None:
        if state == "ERR":
            self.reads_failed += 1
            h.state = TransferState.ERR
        elif state == "DONE":
            h.state = TransferState.DONE
        if h.state is not TransferState.PROC:
            self._inflight.get(h.peer.agent_name, set()).discard(id(h))
            if not h.wall_s:
                h.wall_s = time.perf_counter() - h.t_start

    def poll(self, handle: _Handle) -> TransferState:
        if handle.state is TransferState.PROC:
            self._set_state(handle, self._agent.check_xfer_state(handle.xfer))
        return handle.state

    def wait(self, handle: _Handle, timeout_s: float | None = None) -> ReadResult:
        """Poll until DONE/ERR or the timeout (TransferError). Polls back to back for the first SPIN_S (a CMA
        or RDMA read of a few MB is done by then), then every POLL_SLEEP_S: on two cores a reader spinning for
        seconds takes a core from the ranks it waits on."""
        timeout_s = timeout_s or self.settings.timeout_s
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
        """Post a stalled read again on a fresh endpoint to the same peer (its metadata loaded anew); the caller
        has released (cancelled) the old handle, or keeps it if NIXL could not. Reads are idempotent and the
        DONE notification goes out only when a read completes, so P sees one DONE either way. While other READs
        from that peer are running the endpoint is theirs too: dropping it would fail them all (NIXL invalidates a
        remote agent's transfers when it is removed), so the read is posted again on the same endpoint."""
        self._inflight.get(handle.peer.agent_name, set()).discard(id(handle))
        others = self._inflight.get(handle.peer.agent_name)
        if others:
            log.warning("%d other read(s) from %s running: posting again on the same endpoint", len(others),
                        handle.peer.agent_name)
        else:
            self._drop_peer(handle.peer.agent_name)
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
        self._inflight.get(handle.peer.agent_name, set()).discard(id(handle))

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
        self._sections.clear()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)



def rank_agent(config: Any, engine: Any, side: str, rank: int) -> NixlTransport | None:
    """A node rank's agent over its engine's row pool (`engine.pool.buffer`, engine/api.py `RankEngine`), named
    `<engine id>-<side><rank>` (side "p": per-lease exposure; "d": the pool registered as the READs' target, and
    per-lease exposure of the streams it moves out on drain);
    None when the node runs without a transport (`config.transport` false: tests of the rank protocol alone).
    `config` is the rank's node.rank.WorkerConfig (its engine_id, transport and kv settings)."""
    if not config.transport:
        return None
    return NixlTransport(f"{config.engine_id}-{side}{rank}", engine.pool.buffer, engine.layout.row_bytes, config.kv,
                         per_lease=True, register_pool=side == "d")
