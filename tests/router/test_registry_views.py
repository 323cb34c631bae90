"""`Registry.snapshot` hands out the last view of an instance while nothing it copied changed, and a new one, equal
to a view built from scratch, after any change (in-flight count, load facts, health, draining, spec, facts)."""

from __future__ import annotations

from dataclasses import replace

from router.config import InstanceSpec
from router.facts import CacheFacts, LoadFacts, ModelFacts
from router.registry import InstanceView, Registry, geometry_of


def _fresh(registry: Registry) -> list[InstanceView]:
    """The views as built from scratch (what `snapshot` returned before it kept views)."""
    return [InstanceView(name=s.spec.name, role=s.spec.role, url=s.spec.url, pool=s.spec.pool,
                         geometry=s.geometry or geometry_of(s), is_healthy=s.is_healthy, is_draining=s.is_draining,
                         num_inflight=s.num_inflight, load=s.load, max_model_len=s.models.max_model_len)
            for s in registry.states()]


def test_snapshot_reuses_unchanged_views_and_rebuilds_changed_ones() -> None:
    registry = Registry()
    registry.upsert(InstanceSpec(name="p", role="prefill", url="http://p:1", tp=1))
    registry.upsert(InstanceSpec(name="d", role="decode", url="http://d:1", tp=1))
    d = registry.get("d")
    changes = [  # (change, whether it recomputes every geometry)
        (lambda: setattr(d, "num_inflight", d.num_inflight + 1), False),
        (lambda: setattr(d, "load", LoadFacts(3, 1, 0.5)), False),
        (lambda: setattr(d, "is_healthy", True), False),
        (lambda: setattr(d, "is_draining", True), False),
        (lambda: setattr(d, "models", ModelFacts(model_ids=("m",), max_model_len=4096)), False),
        (lambda: (setattr(d, "cache", CacheFacts(block_size=64)), registry.recompute_matrix()), True),
        (lambda: registry.upsert(InstanceSpec(name="d", role="decode", url="http://d:1", pool="other", tp=1)), True),
        (lambda: setattr(d, "num_inflight", d.num_inflight - 1), False),
    ]
    before = registry.snapshot()
    assert before == _fresh(registry)
    for change, recomputes in changes:
        change()
        d = registry.get("d")
        after = registry.snapshot()
        assert after == _fresh(registry)
        assert after[1] == before[1] and (recomputes or after[1] is before[1])  # states in name order: d, p
        assert after[0] is not before[0] and after[0] != before[0]
        assert registry.snapshot()[0] is after[0]
        before = after
    assert before[0].pool == "other" and before[0].max_model_len == 4096 and before[0].is_draining


def test_a_state_without_geometry_gets_a_new_view_each_time() -> None:
    registry = Registry()
    registry.upsert(InstanceSpec(name="d", role="decode", url="http://d:1"))
    state = registry.get("d")
    state.geometry = None  # as before any recompute: the view's geometry is computed per call
    first, second = registry.view(state), registry.view(state)
    assert first == second and first is not second
    assert replace(first) == first
