"""RouterState: everything one router app owns (created in its lifespan, held on `app.state.router`).

Registry, breakers, sessions, warm pairs, metrics, leg deadlines, the upstream pool for the legs (`upstream`), the httpx
client for health checks and aborts (`client`), the state shared with sibling worker processes
(`shared`, None for a single worker) and background tasks. `pool_views` and `usable_pairs` turn the
mutable parts into the frozen inputs the pure policies take; both are cached between registry changes
and cost nothing per request while every breaker is closed.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import httpx

from router.admission import Admission
from router.breaker import Breakers
from router.cache_view import CacheView
from router.identity import APIKeys
from router.config import PoolSpec, RouterConfig
from router.deadlines import Deadlines
from router.metrics import RouterMetrics
from router.placement import PoolView
from router.readers import Readers
from router.registry import InstanceView, Registry
from router.sessions import SessionTable
from router.settings import Settings
from router.upstream import Upstream


@dataclass
class RouterState:
    settings: Settings
    config: RouterConfig
    client: httpx.AsyncClient
    upstream: Upstream | None = None
    shared: object | None = None
    """router/workers.py `WorkerShared` when the router runs several worker processes."""
    registry: Registry = field(default_factory=Registry)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    breakers: Breakers | None = None
    sessions: SessionTable | None = None
    warm_pairs: frozenset[tuple[str, str]] = frozenset()
    """P-D pairs that completed a handoff (replaced, never mutated: placement takes it as is)."""
    prefill_engine_ids: dict[str, str] = field(default_factory=dict)
    background: set[asyncio.Task] = field(default_factory=set)
    deadlines: Deadlines = field(default_factory=Deadlines)
    admission: Admission | None = None
    api_keys: APIKeys | None = None
    cache_view: CacheView = field(default_factory=CacheView)
    """What each node's prefix cache holds per session (router/cache_view.py)."""
    readers: Readers | None = None
    """The engine id each hand-off for a decode instance is bound to (router/readers.py)."""
    _pool_views: tuple[int, list[PoolView]] = (-1, [])

    def __post_init__(self) -> None:
        s = self.settings
        self.breakers = self.breakers or Breakers(s.breaker_failure_threshold, s.breaker_recovery_s)
        self.sessions = self.sessions or SessionTable(s.session_ttl_s, s.max_sessions)
        self.admission = self.admission or Admission(s, self.metrics)
        self.api_keys = self.api_keys or APIKeys.from_settings(s.api_keys, s.api_keys_file)
        self.readers = self.readers or Readers(self.registry, self.cache_view, self.client, s.cache_poll_timeout_s)
        for spec in self.config.instances:
            self.registry.upsert(spec)

    def next_request_id(self) -> str:
        """A fresh id for one request: the worker's number, then 128 random bits, so unique across worker processes
        and replicas and unguessable from any other id a client saw (a node aborts by id); never the client's."""
        return f"pdc-{self.settings.worker_id}-{os.urandom(16).hex()}"

    def spawn(self, coro) -> None:
        """Run a best-effort side task (aborts) that must outlive a cancelled request."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def pool_specs(self) -> list[PoolSpec]:
        declared = {p.name: p for p in self.config.pools}
        for state in self.registry.states():
            if state.spec.role == "decode" and state.spec.pool not in declared:
                declared[state.spec.pool] = PoolSpec(name=state.spec.pool, kind="tp")
        return list(declared.values())

    @property
    def is_multi_worker(self) -> bool:
        return self.shared is not None

    def pool_views(self, instances: list[InstanceView]) -> list[PoolView]:
        """Pool capacities (declared, else the smallest max_model_len of its decodes); cached per registry
        version (facts, specs and health change only through `Registry.recompute_matrix`)."""
        version, views = self._pool_views
        if version == self.registry.version:
            return views
        views = []
        for spec in self.pool_specs():
            capacity = spec.max_context_tokens
            if capacity is None:
                lens = [v.max_model_len for v in instances
                        if v.role == "decode" and v.pool == spec.name and v.max_model_len]
                capacity = min(lens) if lens else None
            views.append(PoolView(name=spec.name, kind=spec.kind, capacity_tokens=capacity))
        self._pool_views = (self.registry.version, views)
        return views

    def usable_pairs(self, now: float) -> frozenset[tuple[str, str]]:
        """Compatible pairs whose link breaker and prefill breaker let a request through."""
        assert self.breakers is not None
        compatible = self.registry.compatible_pairs
        if not self.breakers.tripped:
            return compatible
        return frozenset(key for key in compatible
                         if self.breakers.link(*key).allows(now) and self.breakers.instance(key[0]).allows(now))

    def usable_move_pairs(self, now: float) -> frozenset[tuple[str, str]]:
        """Decode -> decode pairs a session's KV may move over now: compatible, link and source breakers closed."""
        assert self.breakers is not None
        pairs = self.registry.move_pairs
        if not self.breakers.tripped:
            return pairs
        return frozenset(key for key in pairs
                         if self.breakers.link(*key).allows(now) and self.breakers.instance(key[0]).allows(now))

    def blocked_instances(self, now: float) -> frozenset[str]:
        """Instances whose own breaker lets no request through now (placement skips them as decodes)."""
        assert self.breakers is not None
        if not self.breakers.tripped:
            return frozenset()
        return frozenset(name for name, breaker in self.breakers.instances.items() if not breaker.allows(now))

    def set_warm(self, pair: tuple[str, str], is_warm: bool) -> None:
        if (pair in self.warm_pairs) != is_warm:
            self.warm_pairs = self.warm_pairs | {pair} if is_warm else self.warm_pairs - {pair}

    def note_prefill_engine(self, prefill: str, engine_id: str | None) -> None:
        """A prefill whose engine id changed restarted: its handshakes with every decode are cold."""
        if engine_id is None:
            return
        if self.prefill_engine_ids.get(prefill) not in (None, engine_id):
            self.warm_pairs = frozenset(pair for pair in self.warm_pairs if pair[0] != prefill)
        self.prefill_engine_ids[prefill] = engine_id

    def refresh_gauges(self) -> None:
        assert self.breakers is not None and self.sessions is not None
        m, now = self.metrics, time.monotonic()
        m.reset_gauges()
        healthy = {}
        for state in self.registry.states():
            spec = state.spec
            healthy[spec.name] = state.is_healthy and not state.is_draining
            m.instance_healthy.labels(spec.name, spec.role, spec.pool).set(1 if state.is_healthy else 0)
        for (p, d), verdict in self.registry.matrix.items():
            m.pair_compatible.labels(p, d).set(1 if verdict.is_compatible else 0)
            usable = verdict.is_compatible and healthy.get(p) and healthy.get(d) and \
                self.breakers.link(p, d).allows(now) and self.breakers.instance(p).allows(now)
            m.pair_healthy.labels(p, d).set(1 if usable else 0)
        counts = self.sessions.count_by_pool(now)
        m.prime([pool.name for pool in self.pool_specs()], sorted(self.registry.served_model_ids()))
        self.admission.publish([pool.name for pool in self.pool_specs()])
        for pool in self.pool_specs():
            m.active_sessions.labels(pool.name).set(counts.get(pool.name, 0))
