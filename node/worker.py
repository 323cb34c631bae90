"""The object each rank process runs: an engine backend plus, where the node transfers KV, its role's hooks.

`build_worker(config, ctx)` is the executor's factory (node/executor.py). The worker turns executor commands
into backend calls, in the same order on every rank, and calls the node kind's `RankRole` (node/rank.py) around
them: the role owns the rank's transport and its side of the hand-off (prefill_node/rank_exporter.py,
decode_node/rank_importer.py); the worker knows neither. Per command: the role may claim it (`ImportKV`), an
`Abort` reaches the role before the engine, and every round's events are the engine step's then the role's.
A rank without a role answers an `ImportKV` with an error outcome (each `ImportKV` gets exactly one outcome).
Backends implement `Backend` (node/rank.py); `config.backend` names the factory ("reference" = engine/).
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.api import Abort, Command, Event, HoldRows, ImportKV, ImportOutcome, Release, StartDecode, Submit
from node.protocol import RankStats
from node.rank import Backend, RankInfo, RankRole, WorkerConfig

REFERENCE_BACKEND = "node.backend:build_backend"


def load(path: str) -> Any:
    """The object a "module:name" path names (imported in the calling process)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _backend_path(path: str) -> str:
    return REFERENCE_BACKEND if path == "reference" else path


def backend_module(path: str) -> Any:
    """The backend's module; it also provides `load_tokenizer(model_config)` for the server process."""
    return importlib.import_module(_backend_path(path).split(":")[0])


class RankWorker:
    def __init__(self, config: WorkerConfig, ctx: Any, backend: Backend, role: RankRole | None = None) -> None:
        self.config = config
        self.ctx = ctx
        self.backend = backend
        self.role = role

    def startup_info(self) -> RankInfo:
        layout = self.backend.layout
        transport = self.role.transport if self.role is not None else None
        return RankInfo(rank=self.ctx.rank, num_rows=self.backend.num_rows(), block_size=layout.block_size,
                        row_bytes=layout.row_bytes, subblock_tokens=layout.subblock_tokens,
                        layout_fingerprint=layout.fingerprint,
                        cache_dtype=f"{layout.latent_format}+{layout.index_key_format}",
                        kda_groups=layout.kda_groups,
                        endpoint=transport.endpoint(self.ctx.rank) if transport is not None else None,
                        tcp_fallback=bool(transport is not None and transport.tcp_fallback),
                        kernels=getattr(self.backend, "kernels", "reference"))

    def begin_round(self, now: float) -> None:
        self.backend.begin_round(now)

    def apply(self, cmd: Command) -> list[Event]:
        claimed = self.role.apply(cmd) if self.role is not None else None
        if claimed is not None:
            return claimed
        if isinstance(cmd, Submit):
            return self.backend.submit(cmd)
        if isinstance(cmd, ImportKV):
            return [ImportOutcome(request_id=cmd.request_id, error=f"rank {self.ctx.rank}: this node imports no KV")]
        if isinstance(cmd, StartDecode):
            return self.backend.start_decode(cmd.request_id)
        if isinstance(cmd, Abort):
            ended = self.role.abort(cmd.request_id) if self.role is not None else []
            return ended + self.backend.abort(cmd.request_id)
        if isinstance(cmd, Release):
            self.backend.release(cmd)
            return []
        if isinstance(cmd, HoldRows):
            self.backend.hold(cmd.request_id)
            return []
        raise ValueError(f"unknown command {type(cmd).__name__}")

    def step(self) -> list[Event]:
        events = self.backend.step()
        if self.role is not None:
            events += self.role.step()
        return events

    def stats(self) -> RankStats:
        return self.backend.stats()

    def close(self) -> None:
        if self.role is not None:
            self.role.close()
        self.backend.close()


def build_worker(config: WorkerConfig, ctx: Any) -> RankWorker:
    """The executor's rank factory: the backend, then the role the config names (it registers the pool)."""
    backend = load(_backend_path(config.backend))(config, ctx)
    role = load(config.rank_role)(config, ctx.rank, backend) if config.rank_role else None
    return RankWorker(config, ctx, backend, role)
