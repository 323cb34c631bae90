"""A node rank's engine, built from (EngineConfig, parallel context): the one factory a node's ranks run
(node/worker.py names it by path, "engine.rank_engine:build_rank_engine"); the engine it returns applies the rank
commands itself (engine/api.py `RankEngine`: `Engine.apply`, `import_kv`, `step_events`, `rank_stats`).

What it decides: where the rank computes (`config.device` "cuda" is the GPU the rank's context bound: rank r on the
node's local GPU r; weights, the row pool and every intermediate there), what the rank holds of the weights (its
shard of a TP or DCP group, engine/model/shards.py, with either kernel set), which SPMD wrapper runs the model
(engine/parallel/spmd.py: `TimedModel` on one rank, `TPModel` over a TP group, `DCPModel` on a DCP pool with its
`DCPRowCache` views), then the engine's kernel set (engine/kernels.py, resolved by the Engine: an explicit "fast" it
cannot run raises here naming why) and its warm-up before the rank reports in. The config is used whole (no field
copied); a DCP pool runs one rank per DCP rank.
Imports no torch at module level: a node's server process may import it without loading torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.api import EngineConfig

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("pdcluster.engine")


def rank_device(device: str, ctx: Any) -> Any:
    """Where this rank computes (a torch.device): the CPU, or the GPU its context bound (rank r: the node's local
    GPU r). ValueError for any other device, or "cuda" on a context bound to no GPU."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if ctx.device.type != "cuda":
        raise ValueError(f"device cuda needs a rank context bound to a GPU (NCCL group); this rank got {ctx.device}")
    return ctx.device


def build_rank_engine(config: EngineConfig, ctx: Any, clock: Callable[[], float] = time.monotonic,
                      token_shard_min_tokens: int = 1, warm_decode: bool = True) -> Engine:
    """Rank `ctx.rank`'s engine (engine.engine.Engine) of a node of `ctx.world_size` ranks.

    `clock`: the time quarantines are measured in (a node passes its round's time, the same on every rank);
    `token_shard_min_tokens`: the shortest prefill step a TP/DCP group token-shards (shorter ones are
    head-sharded); `warm_decode`: the warm-up also captures the decode graphs (fast kernels on CUDA; a prefill
    node never decodes)."""
    from engine.engine import Engine
    from engine.model.config import resolve_model
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model
    from engine.parallel.spmd import DCPModel, TimedModel, TPModel

    if config.dcp_size > 1 and config.dcp_size != ctx.world_size:
        raise ValueError(f"a DCP pool runs one rank per DCP rank: dcp_size {config.dcp_size}, {ctx.world_size} ranks")
    device = rank_device(config.device, ctx)
    config = dataclasses.replace(config, device=str(device))
    # a rank of a TP/DCP group holds only its shard of the weights (engine/model/shards.py), whatever its kernels
    shard = ShardSpec(ctx.world_size, ctx.rank)
    built = build_model(resolve_model(config.model, config.exact_index_scores), config.seed, config.weights,
                        device=device, shard=shard)
    if ctx.rank == 0 and ctx.world_size > 1:
        held = sum(p.numel() * p.element_size() for p in built.parameters())
        whole = sum(math.prod(built.splits[n].full_shape) * p.element_size() for n, p in built.named_parameters())
        log.info("rank 0 of %d holds %.1f MB of the model's %.1f MB of weights (its shard; pdcluster plan --shards)",
                 ctx.world_size, held / 1e6, whole / 1e6)
    make_cache = None
    if config.dcp_size > 1:
        model: Any = DCPModel(built, ctx, token_shard_min_tokens)
        make_cache = model.make_cache
    elif ctx.world_size > 1:
        model = TPModel(built, ctx, token_shard_min_tokens)
    else:
        model = TimedModel(built)
    engine = Engine(config, model=model, make_cache=make_cache, clock=clock)
    started = time.perf_counter()
    warmed = engine.warm_up(decode=warm_decode)  # compilation and decode graphs (fast, CUDA), before reporting in
    if warmed is not None and ctx.rank == 0:
        log.info("fast kernels warmed up in %.1f s (decode graphs for batches %s; seconds per phase %s)",
                 time.perf_counter() - started, warmed, getattr(engine.model, "warm_up_seconds", {}))
    return engine
