"""Process groups and rank processes: the one place a distributed world is created and torn down.

`ParallelContext` is the explicit handle every parallel op takes (no rank globals). `world_size == 1`
carries no process group, and every op in this package then runs the plain single-rank path with no
collective at all. `RankPool` starts W long-lived rank processes (spawn, one torch thread each, pinned
round-robin to the cores this process may use), joins them into one gloo (CPU) or NCCL (GPU) group on a
free 127.0.0.1 port, and runs picklable functions `fn(ctx, *args)` on all ranks; node servers keep one
pool for their lifetime, tests and benchmarks open one per world size. Shutdown is explicit (`close`),
bounded in time, and kills stragglers by their own pid only.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from engine.ports import free_port


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is in its parallel group. Passed into every parallel op."""

    rank: int
    """Rank in the group, 0..world_size-1."""
    world_size: int
    """Number of ranks; 1 means the plain single-rank path (no group, no collectives)."""
    group: Any = None
    """The torch.distributed ProcessGroup, or None when world_size == 1."""
    device: torch.device = torch.device("cpu")
    """Device this rank computes on."""
    backend: str = "none"
    """'gloo', 'nccl' or 'none' (single rank)."""

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        """The single-rank context: every parallel op reduces to its plain path."""
        return cls(rank=0, world_size=1, group=None, device=torch.device(device), backend="none")

    @property
    def is_single(self) -> bool:
        return self.world_size == 1


class RankError(RuntimeError):
    """A rank raised, died, or did not answer in time."""


def default_backend(device: str | None = None) -> str:
    """The group backend for ranks computing on `device`: gloo for "cpu", NCCL for "cuda" (a clear error when no
    GPU is visible). None (benchmarks' RankPool): NCCL whenever a GPU is visible, else gloo."""
    if device is None:
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    kind = str(device).split(":")[0]
    if kind == "cpu":
        return "gloo"
    if kind != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise ValueError(f"device {device!r}: no CUDA device is visible to this process")
    return "nccl"


def init_context(rank: int, world_size: int, init_method: str, backend: str,
                 timeout_s: float = 120.0) -> ParallelContext:
    """Join the process group (or make the single-rank context when world_size == 1)."""
    if backend == "nccl":  # rank r binds local GPU r (a node sees its own GPUs through CUDA_VISIBLE_DEVICES)
        count = torch.cuda.device_count()
        if world_size > count:
            raise ValueError(f"{world_size} ranks on NCCL need {world_size} GPUs, {count} visible: NCCL refuses two "
                             "ranks of one group on one GPU")
        device = torch.device("cuda", rank % count)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return ParallelContext(rank=0, world_size=1, group=None, device=device, backend="none")
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(rank=rank, world_size=world_size, group=dist.group.WORLD, device=device,
                           backend=backend)


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the driver process dies, so no rank outlives it (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _pin(rank: int, cores: Sequence[int]) -> None:
    torch.set_num_threads(1)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, cores: list[int],
                 conn: Connection) -> None:
    _die_with_parent()
    _pin(rank, cores)
    try:
        ctx = init_context(rank, world_size, init_method, backend)
        conn.send(("ready", None))
    except Exception:  # report, then exit: the parent raises RankError
        conn.send(("err", traceback.format_exc()))
        return
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args = msg
            try:
                conn.send(("ok", fn(ctx, *args)))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


class RankPool:
    """W rank processes in one process group, driven from this (non-rank) process.

    `run(fn, *args)` calls `fn(ctx, *args)` on every rank and returns the W results in rank order;
    `run_each(fn, per_rank_args)` gives each rank its own arguments. Functions and results must pickle.
    A rank that raises, dies or overruns `timeout_s` raises RankError here; the pool is then unusable
    (`alive` is False) and should be closed.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout_s: float = 300.0,
                 cores: Sequence[int] | None = None) -> None:
        self.world_size = world_size
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        if cores is None:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spawn = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._broken = False
        for rank in range(world_size):
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=_worker_main, daemon=True, name=f"pdcluster-rank{rank}",
                                 args=(rank, world_size, init_method, self.backend, list(cores), child))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._collect()
        except RankError:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return not self._broken and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return self.run_each(fn, [args] * self.world_size)

    def run_each(self, fn: Callable[..., Any], per_rank_args: Sequence[tuple]) -> list[Any]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(per_rank_args)}")
        if not self.alive:
            raise RankError("rank pool is not alive")
        for conn, args in zip(self._conns, per_rank_args):
            conn.send((fn, tuple(args)))
        return self._collect()

    def _collect(self) -> list[Any]:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            while True:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    self._broken = True
                    raise RankError(f"rank {rank} did not answer within {self.timeout_s:.0f} s")
                if conn.poll(min(left, 0.5)):
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        self._broken = True
                        raise RankError(f"rank {rank} closed its pipe (exit code {proc.exitcode})")
                    break
                if not proc.is_alive():
                    self._broken = True
                    raise RankError(f"rank {rank} died with exit code {proc.exitcode}")
            if status == "err":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        if errors:
            self._broken = True
            raise RankError("\n".join(errors))
        return results

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank: ask politely, then terminate and kill stragglers by pid."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout_s)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        self._broken = True

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
              timeout_s: float = 300.0) -> list[Any]:
    """One-shot: start W ranks, run `fn(ctx, *args)` on each, shut down, return results in rank order."""
    with RankPool(world_size, backend=backend, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args)
