"""The registry: every known instance with its spec, node facts, health and router-side load.

Sources (static YAML, the CLI quick start, Kubernetes discovery) call `upsert` / `remove`; the health
checker updates facts and health; request handling bumps in-flight counters. Policies never read this
mutable state directly: `snapshot()` hands them `InstanceView`s (copies, never changed once built). What only changes with specs,
facts or health (geometry, the compat matrix, compatible pairs, served model ids) is recomputed in
`recompute_matrix()` (every source and the health checker call it on a change), never per request;
`version` counts those recomputations so callers can cache what they derive from them.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from urllib.parse import urlparse

from kv_transfer.geometry import Geometry
from router.compat import PairVerdict, compat_matrix, move_matrix
from router.config import InstanceSpec
from router.facts import CacheFacts, LoadFacts, ModelFacts


@dataclass
class InstanceState:
    spec: InstanceSpec
    cache: CacheFacts = field(default_factory=CacheFacts)
    load: LoadFacts = field(default_factory=LoadFacts)
    models: ModelFacts = field(default_factory=ModelFacts)
    is_healthy: bool = False
    num_consecutive_failures: int = 0
    num_consecutive_successes: int = 0
    is_draining: bool = False
    num_inflight: int = 0
    last_error: str | None = None
    geometry: Geometry | None = None
    """geometry_of(self) as of the last recompute_matrix()."""
    last_view: tuple[InstanceView, InstanceSpec, ModelFacts] | None = field(default=None, repr=False, compare=False)
    """The view `Registry.view` last built of this state, with the spec and model facts it copied (it is handed out
    again while every field it copied is unchanged)."""


# Not frozen: built per request, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about
# twice a plain one on the hot path. Nothing mutates it once built (changes go through dataclasses.replace).
@dataclass
class InstanceView:
    """Per-request view of one instance (a copy), what placement and compat see."""

    name: str
    role: str
    url: str
    pool: str
    geometry: Geometry
    is_healthy: bool
    is_draining: bool
    num_inflight: int
    load: LoadFacts
    max_model_len: int | None

    @property
    def is_usable(self) -> bool:
        return self.is_healthy and not self.is_draining

    @property
    def host(self) -> str:
        return host_of(self.url)


@functools.lru_cache(maxsize=4096)
def host_of(url: str) -> str:
    """The host part of an instance URL (parsed once per URL: the P leg asks for it on every request)."""
    return urlparse(url).hostname or "127.0.0.1"


def geometry_of(state: InstanceState) -> Geometry:
    """Spec values win where the operator set them; node facts fill the rest. vLLM defaults to TP 1. `tp` is the
    instance's TP group width with DCP ranks included (vLLM's --tensor-parallel-size), so DCP divides it."""
    spec, cache = state.spec, state.cache
    engine = spec.engine or cache.engine or None
    model = spec.model or (state.models.model_ids[0] if state.models.model_ids else None)
    tp = spec.tp or cache.tp_size or (1 if engine == "vllm" else None)
    dcp = spec.dcp or cache.dcp_size or 1
    models = state.models
    weights = models.weights_fingerprint or (f"path {models.root}" if engine == "vllm" and models.root else None)
    return Geometry(name=spec.name, engine=engine, model=model, tp=tp, dcp=dcp,
                    block_size=spec.block_size or cache.block_size, cache_dtype=cache.cache_dtype,
                    layout_fingerprint=cache.layout_fingerprint, weights=weights)


class Registry:
    def __init__(self) -> None:
        self._instances: dict[str, InstanceState] = {}
        self._matrix: dict[tuple[str, str], PairVerdict] = {}
        self.compatible_pairs: frozenset[tuple[str, str]] = frozenset()
        self.move_pairs: frozenset[tuple[str, str]] = frozenset()
        """(source decode, destination decode) pairs whose kept KV may move decode-to-decode (compat.move_matrix)."""
        self._served_ids: set[str] = set()
        self._known_ids: set[str] = set()
        self._states: list[InstanceState] = []
        self.version = 0
        self.drained: set[str] = set()
        """Names an admin drained (router/admin.py), kept for instances that appear later."""

    def upsert(self, spec: InstanceSpec) -> None:
        current = self._instances.get(spec.name)
        if current is None or current.spec.url != spec.url:
            self._instances[spec.name] = InstanceState(spec=spec, is_draining=spec.name in self.drained)
        else:
            current.spec = spec
        self.recompute_matrix()

    def remove(self, name: str) -> None:
        if self._instances.pop(name, None) is not None:
            self.recompute_matrix()

    def get(self, name: str) -> InstanceState | None:
        return self._instances.get(name)

    def names(self) -> list[str]:
        return sorted(self._instances)

    def states(self) -> list[InstanceState]:
        return list(self._states)

    def recompute_matrix(self) -> None:
        self._states = [self._instances[n] for n in sorted(self._instances)]
        for state in self._states:
            state.geometry = geometry_of(state)
        prefills = [s.geometry for s in self._states if s.spec.role == "prefill"]
        decodes = [s.geometry for s in self._states if s.spec.role == "decode"]
        self._matrix = compat_matrix(prefills, decodes)
        self.compatible_pairs = frozenset(key for key, verdict in self._matrix.items() if verdict.is_compatible)
        self.move_pairs = frozenset(key for key, verdict in move_matrix(decodes).items() if verdict.is_compatible)
        self._served_ids = {str(card["id"]) for card in self.served_models()}
        self._known_ids = {str(card["id"]) for card in self.served_models(healthy_only=False)}
        self.version += 1

    def served_model_ids(self) -> set[str]:
        """Ids of the models healthy decode instances serve (as of the last recompute)."""
        return self._served_ids

    def known_model_ids(self) -> set[str]:
        """Ids of the models any registered decode instance serves, healthy or not: a request for one of
        them is not a 404 while its instances are down (placement answers 503 with Retry-After)."""
        return self._known_ids

    @property
    def matrix(self) -> dict[tuple[str, str], PairVerdict]:
        return self._matrix

    def view(self, state: InstanceState) -> InstanceView:
        """A copy of what policies see of `state`. Views are never changed once built, so the last one is handed
        out again while every field it copied is the same (the spec, geometry and facts are replaced whole, never
        changed in place): a snapshot per request then builds views only of the instances that changed."""
        if state.last_view is not None:
            last, spec, models = state.last_view
            if last.num_inflight == state.num_inflight and last.load is state.load and spec is state.spec \
                    and last.is_healthy == state.is_healthy and last.is_draining == state.is_draining \
                    and last.geometry is state.geometry and models is state.models:
                return last
        view = InstanceView(name=state.spec.name, role=state.spec.role, url=state.spec.url,
                            pool=state.spec.pool, geometry=state.geometry or geometry_of(state),
                            is_healthy=state.is_healthy,
                            is_draining=state.is_draining, num_inflight=state.num_inflight, load=state.load,
                            max_model_len=state.models.max_model_len)
        if state.geometry is not None:  # else the view's geometry was computed here, and is new each time
            state.last_view = (view, state.spec, state.models)
        return view

    def snapshot(self) -> list[InstanceView]:
        return [self.view(s) for s in self._states]

    def served_models(self, healthy_only: bool = True) -> list[dict]:
        """Model cards of healthy (or, `healthy_only=False`, all) decode instances, de-duplicated by id."""
        cards: dict[str, dict] = {}
        for state in self.states():
            if state.spec.role != "decode" or (healthy_only and not state.is_healthy):
                continue
            for card in state.models.raw_cards:
                cards.setdefault(str(card["id"]), dict(card))
            if state.spec.model and state.spec.model not in cards:
                cards[state.spec.model] = {"id": state.spec.model, "object": "model", "owned_by": "pdcluster"}
        return list(cards.values())
