"""The object each rank process runs: the rank's engine plus, where the node transfers KV, its role's hooks.

`build_worker(config, ctx)` is the executor's factory (node/executor.py): it builds the rank's engine through the
factory `config.backend` names ("reference": engine/rank_engine.py `build_rank_engine`) and the node kind's
`RankRole` (node/rank.py) over it. The engine applies the rank commands itself (engine/api.py `RankEngine`): the
worker hands each command on unchanged, in the same order on every rank, and calls the role around it. The role
owns the rank's transport and its side of the hand-off (prefill_node/rank_exporter.py,
decode_node/rank_importer.py); the worker knows neither. Per command: the role may claim it (`ImportKV`), an
`Abort` reaches the role before the engine, and every round's events are the engine step's then the role's (the
role sees the engine's first: a prefill rank exposes the rows of each export to its transport).
A rank without a role answers an `ImportKV` with an error outcome (each `ImportKV` gets exactly one outcome).
Time: the engine measures quarantines in `RoundClock`, the driver's round time (the same on every rank).
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.api import Abort, Command, Event, ImportKV, ImportOutcome, RankEngine, RankStats
from node.rank import RankInfo, RankRole, WorkerConfig

REFERENCE_ENGINE = "engine.rank_engine:build_rank_engine"


def load(path: str) -> Any:
    """The object a "module:name" path names (imported in the calling process)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def engine_factory_path(backend: str) -> str:
    """The "module:function" of the ranks' engine factory that `WorkerConfig.backend` names."""
    return REFERENCE_ENGINE if backend == "reference" else backend


class RoundClock:
    """The time a rank's engine measures quarantines in: the round's (`StepPlan.now`), set before its commands."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RankWorker:
    def __init__(self, ctx: Any, engine: RankEngine, clock: RoundClock, role: RankRole | None = None) -> None:
        self.ctx = ctx
        self.engine = engine
        self.clock = clock
        self.role = role

    def startup_info(self) -> RankInfo:
        layout = self.engine.layout
        transport = self.role.transport if self.role is not None else None
        return RankInfo(rank=self.ctx.rank, num_rows=self.engine.config.num_rows, block_size=layout.block_size,
                        row_bytes=layout.row_bytes, subblock_tokens=layout.subblock_tokens,
                        layout_fingerprint=layout.fingerprint,
                        cache_dtype=f"{layout.latent_format}+{layout.index_key_format}",
                        kda_groups=layout.kda_groups,
                        endpoint=transport.endpoint(self.ctx.rank) if transport is not None else None,
                        tcp_fallback=bool(transport is not None and transport.tcp_fallback),
                        kernels=self.engine.kernels)

    def begin_round(self, now: float) -> None:
        self.clock.now = now

    def apply(self, cmd: Command) -> list[Event]:
        claimed = self.role.apply(cmd) if self.role is not None else None
        if claimed is not None:
            return claimed
        if isinstance(cmd, ImportKV):
            return [ImportOutcome(request_id=cmd.request_id, error=f"rank {self.ctx.rank}: this node imports no KV")]
        if isinstance(cmd, Abort) and self.role is not None:
            return self.role.abort(cmd.request_id) + self.engine.apply(cmd)
        return self.engine.apply(cmd)

    def step(self) -> list[Event]:
        events = self.engine.step_events()
        if self.role is not None:
            events += self.role.step(events)
        return events

    def stats(self) -> RankStats:
        return self.engine.rank_stats(report_cache=self.ctx.rank == 0)  # every rank's cache decides alike

    def close(self) -> None:
        if self.role is not None:
            self.role.close()


def build_worker(config: WorkerConfig, ctx: Any) -> RankWorker:
    """The executor's rank factory: the engine, then the role the config names (it registers the pool)."""
    clock = RoundClock()
    engine = load(engine_factory_path(config.backend))(config.engine, ctx, clock,
                                                       token_shard_min_tokens=config.token_shard_min_tokens,
                                                       warm_decode=config.role != "prefill")
    role = load(config.rank_role)(config, ctx.rank, engine) if config.rank_role else None
    return RankWorker(ctx, engine, clock, role)
