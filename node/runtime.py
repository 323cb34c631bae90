"""Start a node's engine: the worker config the ranks build from, and the NodeRuntime the app serves with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from engine.api import DEFAULT_SEED
from kv_transfer.ucx_env import KVTransferSettings
from node.app import NodeRuntime
from node.executor import Executor, WorkerSpec
from node.metrics import CacheInfo, NodeMetrics
from node.settings import NodeSettings
from node.textgen import Limits

WORKER_FACTORY = "node.worker:build_worker"
log = logging.getLogger("pdcluster.node")


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank needs to build its engine replica (picklable)."""

    model: str
    role: str
    seed: int | None
    num_rows: int
    block_size: int | None
    tp_size: int
    dcp_size: int
    max_num_seqs: int
    engine_id: str
    token_shard_min_tokens: int = 1
    backend: str = "reference"
    """"reference" (engine/) or a "module:function" backend factory."""
    transport: bool = True
    """Register the pool with NIXL (needed for P -> D transfer)."""
    kv: KVTransferSettings = KVTransferSettings()
    """The node's KV transfer settings (the rank's NIXL agent, the import deadline)."""
    device: str = "cpu"
    """"cpu" or "cuda": each rank builds its weights, row pool and intermediates on its own GPU (NIXL: VRAM)."""
    prefix_cache: bool = True
    """The engine's prefix cache (engine/prefix_cache.py) on or off."""
    max_step_tokens: int | None = None
    """Chunked prefill's per-step token budget (None: whole prompts)."""
    kernels: str = "auto"
    """Kernel set the rank engines are asked for: "auto", "reference" or "fast" (engine/kernels.py resolves it)."""


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once ready."""

    rank: int
    num_rows: int
    block_size: int
    row_bytes: int
    subblock_tokens: int
    layout_fingerprint: str
    cache_dtype: str
    kda_groups: int
    endpoint: Any = None
    """kv_transfer.transport.RankEndpoint of this rank's registered pool (None without a transport)."""
    tcp_fallback: bool = False
    """UCX can only move this pool's bytes over TCP (kv_transfer.ucx_env.detect_tcp_fallback)."""
    kernels: str = "reference"
    """The kernel set this rank's engine runs ("reference" | "fast")."""


def worker_config(settings: NodeSettings, role: str, dcp_size: int = 1, token_shard_min_tokens: int = 1
                  ) -> WorkerConfig:
    return WorkerConfig(model=settings.model, role=role, seed=settings.seed, num_rows=settings.num_rows,
                        block_size=settings.block_size, tp_size=settings.tp, dcp_size=dcp_size,
                        max_num_seqs=settings.max_num_seqs, engine_id=settings.engine_id,
                        token_shard_min_tokens=token_shard_min_tokens, backend=settings.backend,
                        transport=settings.transport, kv=settings.kv, device=settings.device,
                        prefix_cache=settings.prefix_cache, max_step_tokens=settings.max_step_tokens,
                        kernels=settings.kernels)


TOKENIZER_PROBE = "pdcluster tokenizer probe: Hello, world! 123 \u00e9\u4e2d\U0001f600"
"""Encoded by the served tokenizer into the weights fingerprint (a different vocabulary shows)."""


def served_weights_fingerprint(model_cfg: Any, seed: int, tokenizer: Any) -> str:
    """What a P/D pair must share for KV to mean the same: the model config, the weights (the seed the
    ranks initialise them from) and the tokenizer (its class, vocabulary size and encoding of a probe)."""
    config = dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else repr(model_cfg)
    tok = [type(tokenizer).__name__, type(getattr(tokenizer, "inner", None)).__name__,
           getattr(tokenizer, "vocab_size", None), tokenizer.encode(TOKENIZER_PROBE)]
    text = json.dumps({"model": config, "seed": seed, "tokenizer": tok}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def start_runtime(settings: NodeSettings, config: WorkerConfig, world_size: int) -> NodeRuntime:
    """Spawn the ranks (blocking until ready) and assemble the runtime."""
    from engine.model.config import get_preset
    from node.worker import backend_module

    model_cfg = get_preset(settings.model)
    backend = backend_module(config.backend)
    load_tokenizer = backend.load_tokenizer
    spec = WorkerSpec(factory=WORKER_FACTORY, config=config, world_size=world_size, pin_cores=settings.pin_cores,
                      step_timeout_s=settings.step_timeout_s, device=config.device,
                      process_group=getattr(backend, "PROCESS_GROUP", True))
    executor = Executor(spec)
    executor.start(timeout_s=settings.start_timeout_s)
    head: RankInfo = executor.startup_info[0]
    log.info("%s node: %d rank(s) on %s, kernels %s", config.role, world_size, config.device, head.kernels)
    metrics = NodeMetrics(settings.model, config.role)
    metrics.set_cache_info(CacheInfo(block_size=head.block_size, cache_dtype=head.cache_dtype,
                                     num_gpu_blocks=head.num_rows, layout_fingerprint=head.layout_fingerprint,
                                     tp_size=config.tp_size, dcp_size=config.dcp_size, kernels=head.kernels))
    metrics.set_load(0, 0, 0, head.num_rows)
    metrics.ucx_tcp_fallback.set(float(any(info.tcp_fallback for info in executor.startup_info)))
    limits = Limits(max_context=settings.max_context or model_cfg.max_context,
                    default_max_tokens=settings.default_max_tokens)
    tokenizer = load_tokenizer(model_cfg)
    fingerprint = served_weights_fingerprint(model_cfg, DEFAULT_SEED if config.seed is None else config.seed,
                                             tokenizer)
    return NodeRuntime(executor=executor, tokenizer=tokenizer, limits=limits, metrics=metrics,
                       model=settings.model, role=config.role, weights_fingerprint=fingerprint)
