"""A running node's state and how it starts: the worker config its ranks build from, the spawned ranks, and the
`NodeRuntime` every handler serves with.

`NodeRuntime[H]` holds what both node kinds share (executor, tokenizer, limits, metrics, the requests in flight)
and, typed, the node kind's owner of P->D hand-offs (`handoff`: kv_transfer/exporter.py `Exporter` or
decode_node/importer.py `Importer`). The shared HTTP layer (node/app.py) sees that owner only through `HandOff`.
`start_runtime` spawns the ranks (node/executor.py running node/worker.py), then asks the node package to build
its hand-off owner over them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engine.api import HandOffAbort
from node.executor import Executor, WorkerSpec
from node.metrics import CacheInfo, NodeMetrics
from node.rank import RankInfo, WorkerConfig
from node.settings import NodeSettings
from node.textgen import Limits, Tokenizer
from node.tokenizer import load_tokenizer

WORKER_FACTORY = "node.worker:build_worker"
log = logging.getLogger("pdcluster.node")


class HandOff(Protocol):
    """A node kind's owner of P->D hand-offs as the shared HTTP layer sees it."""

    def holds(self, request_id: str) -> bool:
        """True while hand-off state still names `request_id` (a new request must not take that id)."""

    def abort(self, request_id: str, in_flight: Iterable[str] = ()) -> HandOffAbort:
        """/abort_requests named `request_id` (`in_flight`: its ids still running here, which the caller then
        aborts on the ranks): end what the hand-off keeps for it, and say whether a READ may still target them."""

    @property
    def num_outstanding(self) -> int:
        """What a drain waits for beyond the requests in flight (exported rows a reader may still read)."""


H = TypeVar("H", bound=HandOff)


@dataclass
class NodeRuntime(Generic[H]):
    """Everything a node's handlers use; built in the app's lifespan (`start_runtime`)."""

    executor: Executor
    tokenizer: Tokenizer
    limits: Limits
    metrics: NodeMetrics
    model: str
    role: str
    handoff: H
    """The node kind's owner of hand-offs (see the module docstring)."""
    weights_fingerprint: str | None = None
    """Weights + tokenizer identity reported in /v1/models (`served_weights_fingerprint`)."""
    request_ids: dict[str, str] = field(default_factory=dict)
    """internal id -> external id of requests in flight here."""
    num_finished: int = 0
    """Requests that left this node (their rows went back): admission queues retry when it moves."""
    counters_seen: dict[str, float] = field(default_factory=dict)
    """The ranks' cumulative counters (summed) already added to the node counters."""
    metrics_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises `refresh_load` (the API port and the metrics port both render /metrics)."""

    def new_request_id(self, header: str | None) -> str:
        external = header or uuid.uuid4().hex
        taken = external in self.request_ids or self.handoff.holds(external)
        internal = f"{external}-{uuid.uuid4().hex[:8]}" if taken else external
        self.request_ids[internal] = external
        return internal

    def done(self, internal: str) -> None:
        if self.request_ids.pop(internal, None) is not None:
            self.num_finished += 1

    def render_metrics(self) -> bytes:
        with self.metrics_lock:
            self.refresh_load()
            self.metrics.requests_in_flight.set(len(self.request_ids))
            return self.metrics.render()

    def internal_ids(self, external: str) -> list[str]:
        return [i for i, e in self.request_ids.items() if e == external or i == external]

    def refresh_load(self) -> None:
        """Copy the ranks' latest load into the gauges, and their cumulative counters (summed over ranks)
        into the node counters."""
        stats = self.executor.state.stats
        if not stats:
            return
        head = stats[0]
        self.metrics.set_load(head.num_running, head.num_waiting, head.num_rows_used, head.num_rows_total)
        if self.executor.state.cache is not None:
            self.metrics.prefix_blocks.labels(role=self.role).set(self.executor.state.cache.blocks_cached)
        totals: dict[str, float] = {}
        for rank_stats in stats:
            for name, value in rank_stats.counters:
                totals[name] = totals.get(name, 0.0) + value
        for name, label, seconds in self.executor.state.take_timings():
            self.metrics.observe_timing(name, label, seconds)
        for name, value in totals.items():
            delta = value - self.counters_seen.get(name, 0.0)
            if delta > 0:
                self.metrics.add_counter(name, delta)
                self.counters_seen[name] = value


def worker_config(settings: NodeSettings, role: str, dcp_size: int = 1, token_shard_min_tokens: int = 1,
                  rank_role: str | None = None, tp_size: int | None = None) -> WorkerConfig:
    """The ranks' config from the node's settings: their `engine` section whole, completed with what the node
    decides (`tp_size`: default `settings.tp`; a DCP pool's `dcp_size`; `quarantine_s`: the read timeout);
    `rank_role` names the node kind's RankRole factory."""
    engine = dataclasses.replace(settings.engine, tp_size=tp_size or settings.tp, dcp_size=dcp_size,
                                 quarantine_s=settings.kv.timeout_s)
    return WorkerConfig(engine=engine, role=role, rank_role=rank_role, engine_id=settings.engine_id,
                        token_shard_min_tokens=token_shard_min_tokens, backend=settings.backend,
                        transport=settings.transport, kv=settings.kv)


TOKENIZER_PROBE = "pdcluster tokenizer probe: Hello, world! 123 \u00e9\u4e2d\U0001f600"
"""Encoded by the served tokenizer into the weights fingerprint (a different vocabulary shows)."""
PATH_FIELDS = ("name", "checkpoint")
"""ModelConfig fields that name where a model was read from, not what it computes (left out of the fingerprint, so
two copies of one checkpoint pair)."""


def served_weights_fingerprint(model_cfg: Any, seed: int, tokenizer: Any) -> str:
    """What a P/D pair must share for KV to mean the same: the model config (less its paths), the weights (a
    checkpoint's fingerprint of its files, engine/model/checkpoint.py; a preset's seed) and the tokenizer (its files'
    digest, vocabulary size and encoding of a probe). The router pairs instances only when theirs are equal."""
    from engine.model.checkpoint import weights_fingerprint

    config = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in PATH_FIELDS}
    tok = [tokenizer.fingerprint, tokenizer.vocab_size, tokenizer.encode(TOKENIZER_PROBE)]
    text = json.dumps({"model": config, "weights": weights_fingerprint(model_cfg, seed), "tokenizer": tok},
                      sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def served_model_id(model: str) -> str:
    """The id a node serves its model under: `--model` as given, a directory's trailing slashes removed (as vLLM
    serves a path; cluster/plan.py `served_model_name` gives clients the same)."""
    return model.rstrip("/") or model


def start_runtime(settings: NodeSettings, config: WorkerConfig, world_size: int,
                  handoff: Callable[[Executor, NodeMetrics], H]) -> NodeRuntime[H]:
    """Spawn the ranks (blocking until ready) and assemble the runtime; `handoff(executor, metrics)` builds the
    node kind's hand-off owner once the ranks reported in (`executor.startup_info`)."""
    from engine.model.config import resolve_model

    model_cfg = resolve_model(config.engine.model, config.engine.exact_index_scores)  # what the ranks build
    # before the ranks: bad tokenizer files refuse the start at once. Another engine factory's module (the node
    # tests' toy engine) brings its own tokenizer, and may say its ranks run no collective (PROCESS_GROUP)
    factory_module = None if config.backend == "reference" else importlib.import_module(config.backend.split(":")[0])
    tokenizer = factory_module.load_tokenizer(model_cfg) if factory_module is not None else load_tokenizer(model_cfg)
    fingerprint = served_weights_fingerprint(model_cfg, config.engine.seed, tokenizer)
    spec = WorkerSpec(factory=WORKER_FACTORY, config=config, world_size=world_size, pin_cores=settings.pin_cores,
                      step_timeout_s=settings.step_timeout_s, device=config.engine.device,
                      process_group=getattr(factory_module, "PROCESS_GROUP", True))
    executor = Executor(spec)
    executor.start(timeout_s=settings.start_timeout_s)
    head: RankInfo = executor.startup_info[0]
    log.info("%s node: %d rank(s) on %s, kernels %s", config.role, world_size, config.engine.device,
             head.kernels)
    metrics = NodeMetrics(served_model_id(config.engine.model), config.role)
    metrics.set_cache_info(CacheInfo(block_size=head.block_size, cache_dtype=head.cache_dtype,
                                     num_gpu_blocks=head.num_rows, layout_fingerprint=head.layout_fingerprint,
                                     tp_size=config.engine.tp_size, dcp_size=config.engine.dcp_size,
                                     kernels=head.kernels))
    metrics.set_load(0, 0, 0, head.num_rows)
    metrics.ucx_tcp_fallback.set(float(any(info.tcp_fallback for info in executor.startup_info)))
    limits = Limits(max_context=settings.max_context or model_cfg.max_context,
                    default_max_tokens=settings.default_max_tokens)
    try:
        owner = handoff(executor, metrics)
    except BaseException:
        executor.stop()
        raise
    return NodeRuntime(executor=executor, tokenizer=tokenizer, limits=limits, metrics=metrics,
                       model=served_model_id(config.engine.model), role=config.role, handoff=owner, weights_fingerprint=fingerprint)
