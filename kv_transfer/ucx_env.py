"""Where NIXL's UCX backend gets its configuration: the transfer settings of a node, the NIXL wheel, and what the
host offers (RDMA devices, NVIDIA GPUs, CMA) turned into an explicit UCX_TLS list and error-handling mode.

The settings are the `kv` section of the node settings (node/settings.py: CLI `--kv-ucx-tls`, YAML pool
`settings: {kv: {ucx_tls: ...}}`, env `PREFILL_KV__UCX_TLS` / `DECODE_KV__UCX_TLS`); nothing here reads the
environment.
UCX transports: `KVTransferSettings.ucx_tls` is written to UCX_TLS before the agent starts, so UCX never picks
transports silently; `detect_tcp_fallback` flags a configuration where RMA can only run over TCP (logged as a
warning; feeds the `pdcluster_node_ucx_tcp_fallback` gauge). One UCX context per process: every agent in a
process shares the first one's UCX_TLS.
UCX peer-failure handling (`KVTransferSettings.error_handling`): on a host without an RDMA device the agents'
endpoints run without it, so wire-up and notifications go over shared memory and a first READ needs no TCP
handshake with the remote process; with an RDMA device (peers on other hosts) NIXL's `peer` mode stays.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kv_transfer.nixl_delay import delayed_config_class

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


class KVTransferSettings(BaseModel):
    """KV transfer settings of one node: the `kv` section of its settings (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
    ucx_tls: str = DEFAULT_UCX_TLS
    """UCX transports (UCX_TLS): `auto` (from the hardware present) or an explicit list."""
    capture_telemetry: bool = True
    """NIXL transfer telemetry (the transfer-only time of each READ)."""
    num_threads: int = Field(default=0, ge=0)
    """UCX worker threads (0: NIXL default)."""
    progress_delay_us: int = Field(default=2000, ge=0)
    """How long NIXL's UCX progress thread waits for worker events between progress passes. NIXL's Python
    API fixes it at 0, a busy loop (measured: ~95% of a core per idle rank process, so an idle 5-rank cluster
    on 2 cores starved its own prefill 10x). With a delay the thread sleeps in poll() on the workers' event
    fds, waking at once on traffic (wire-up requests from decode peers while a prefill step runs)."""
    error_handling: Literal["auto", "none", "peer"] = "auto"
    """UCX peer-failure handling of the agent's endpoints (NIXL's `ucx_error_handling_mode`): `peer`, `none`,
    or `auto`. `peer` (NIXL's default) excludes shared-memory transports from the endpoint, so every endpoint
    gets a TCP lane for its active messages (wire-up, notifications, keepalive) and its first READ waits on a
    TCP handshake that the remote worker must progress; `none` sends those over shared memory and connects to
    the remote interface at once. `auto`: `none` when the peers are on this host (CMA or shared memory reads
    fail by themselves if a peer process is gone, and P's leases expire) on a host without an RDMA device,
    `peer` where one is present (peers on other hosts)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Bound on one request's KV import on a decode node: fetching the prefill node's side-channel metadata,
    and its NIXL READs (still running after this long: the import fails)."""
    repost_after_s: float = Field(default=10.0, gt=0)
    """A read still running after this long is cancelled and posted once more on a fresh endpoint to the same
    peer (NixlTransport.repost), within timeout_s. A local CMA read of a whole request takes milliseconds;
    one stalled for seconds is waiting on an endpoint, not on bytes."""
    nixl_module: str | None = None
    """NIXL wheel to import (`nixl_cu12`, `nixl_cu13`); unset: the first of NIXL_MODULES installed."""
    cuda_ipc_get_zcopy: Literal["auto", "y", "n"] = "auto"
    """UCX's cuda_ipc GET (a NIXL READ of VRAM) zero-copy (UCX_CUDA_IPC_ENABLE_GET_ZCOPY). UCX turns it off
    when NVML shows no NVLink, which includes two processes on ONE GPU: the READ then stages through the host
    over cuda_copy (measured on an H200: 0.4-0.8 GB/s; with it on, cuda_ipc moves 400 GB/s in 4 MB rows,
    benchmarks/RESULTS.md). `auto`: `y` for VRAM pools, UCX's own choice for DRAM pools."""


NIXL_MODULES = ("nixl_cu12", "nixl_cu13")
"""NIXL's wheels by CUDA major; the `nixl` meta package may pick one that does not match the machine, so the
wheel is imported by name: `KVTransferSettings.nixl_module` if set, else the first of these that is installed."""


def nixl_api(module: str | None = None) -> Any:
    """NIXL's Python API module (`<module>._api`, default: the first of NIXL_MODULES that imports), imported on
    first use (heavy)."""
    import importlib  # noqa: PLC0415

    errors = []
    for name in ([module] if module else NIXL_MODULES):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("no NIXL wheel could be imported (" + "; ".join(errors) + ")")


@contextlib.contextmanager
def progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """While NIXL (`api`, from nixl_api) builds an agent, its config class keeps `pthrDelay` at `delay_us` (the
    Python API writes 0)."""
    base = api.nixlBind.nixlAgentConfig
    api.nixlBind.nixlAgentConfig = delayed_config_class(base, delay_us)
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


def resolve_cuda_ipc_get_zcopy(setting: str, mem_type: str) -> str | None:
    """The UCX_CUDA_IPC_ENABLE_GET_ZCOPY value for `setting` on a pool of `mem_type` (None: leave UCX's own)."""
    if setting == "auto":
        return "y" if mem_type == "VRAM" else None
    if setting not in ("y", "n"):
        raise ValueError(f"cuda_ipc_get_zcopy must be auto, y or n, got {setting!r}")
    return setting


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
