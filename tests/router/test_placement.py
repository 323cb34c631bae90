"""Placement as pure functions (table-driven): pools by projected context, stickiness, migration, load,
warm pairs, conditional disaggregation, session ids and prompt estimates."""

from __future__ import annotations

import pytest

from router.compat import Geometry
from router.facts import LoadFacts
from router.placement import (NoPlacement, PoolView, RequestShape, SessionRecord, choose_pool,
                              estimate_prompt_tokens, place, rank_prefills, session_id_of)
from router.registry import InstanceView

POOLS = [PoolView("tp-small", "tp", 8_000), PoolView("tp-big", "tp", 32_000), PoolView("dcp", "dcp", 1_000_000)]


def view(name, role="decode", pool="tp-small", healthy=True, draining=False, inflight=0, running=0.0,
         waiting=0.0) -> InstanceView:
    return InstanceView(name=name, role=role, url=f"http://{name}:80", pool=pool,
                        geometry=Geometry(name, "vllm", "m", 1, 1, 16, "auto"), is_healthy=healthy,
                        is_draining=draining, num_inflight=inflight,
                        load=LoadFacts(num_running=running, num_waiting=waiting), max_model_len=None)


@pytest.mark.parametrize("projected,expected", [
    (100, "tp-small"), (8_000, "tp-small"), (8_001, "tp-big"), (32_000, "tp-big"), (32_001, "dcp"),
    (5_000_000, "dcp"),
], ids=["tiny", "exact-small", "just-over-small", "exact-big", "long-agent", "beyond-all"])
def test_choose_pool(projected, expected):
    assert choose_pool(POOLS, projected).name == expected


def test_choose_pool_without_pools():
    with pytest.raises(NoPlacement):
        choose_pool([], 10)


def shape(prompt=100, max_tokens=100, growth=0, session="s") -> RequestShape:
    return RequestShape(session_id=session, prompt_tokens=prompt, max_tokens=max_tokens,
                        expected_growth_tokens=growth)


INSTANCES = [view("p0", "prefill", pool="any"), view("p1", "prefill", pool="any", inflight=3),
             view("d-s0", inflight=2), view("d-s1", inflight=0), view("d-b0", pool="tp-big"),
             view("d-l0", pool="dcp"), view("d-l1", pool="dcp", running=5)]
ALL_PAIRS = frozenset((p, d.name) for p in ("p0", "p1") for d in INSTANCES if d.role == "decode")

# (id, shape, session, expected pool, decode, migration, disaggregate); no node reports a cached prefix here,
# so every request with a compatible prefill disaggregates (cache-driven skips: tests/router/test_cache_routing.py)
PLACE_CASES = [
    ("new-short-least-loaded", shape(), None, "tp-small", "d-s1", False, True),
    ("new-long-to-dcp-least-loaded", shape(prompt=50_000), None, "dcp", "d-l0", False, True),
    ("growth-hint-counts", shape(prompt=1_000, growth=40_000), None, "dcp", "d-l0", False, True),
    ("sticky-even-if-busier", shape(), SessionRecord("s", "tp-small", "d-s0", 500, 0.0), "tp-small", "d-s0",
     False, True),
    ("outgrows-small-pool", shape(prompt=20_000), SessionRecord("s", "tp-small", "d-s0", 7_000, 0.0), "tp-big",
     "d-b0", True, True),
    ("known-context-drives-migration", shape(prompt=100), SessionRecord("s", "tp-small", "d-s0", 40_000, 0.0),
     "dcp", "d-l0", True, True),
    ("dcp-session-stays-on-short-turn", shape(prompt=10), SessionRecord("s", "dcp", "d-l1", 60_000, 0.0), "dcp",
     "d-l1", False, False),
    ("sticky-instance-gone", shape(), SessionRecord("s", "tp-small", "d-gone", 50, 0.0), "tp-small", "d-s1",
     False, True),
]


@pytest.mark.parametrize("case_id,req,session,pool,decode,migration,disagg", PLACE_CASES,
                         ids=[c[0] for c in PLACE_CASES])
def test_place(case_id, req, session, pool, decode, migration, disagg):
    result = place(req, session, POOLS, INSTANCES, ALL_PAIRS, frozenset(), min_uncached_tokens=32)
    assert (result.pool, result.decode, result.is_migration, result.disaggregate) == \
        (pool, decode, migration, disagg), result.reason
    if disagg:
        assert result.prefills[0] == "p0"


def test_unusable_decodes_are_skipped():
    instances = [view("d0", healthy=False), view("d1", draining=True), view("d2", inflight=9)]
    result = place(shape(), None, POOLS, instances, frozenset(), frozenset(), 32)
    assert result.decode == "d2" and not result.disaggregate and result.prefills == ()


def test_no_usable_decode_raises():
    with pytest.raises(NoPlacement):
        place(shape(), None, POOLS, [view("d0", healthy=False)], frozenset(), frozenset(), 32)


def test_decode_with_a_compatible_prefill_is_preferred():
    instances = [view("p0", "prefill"), view("d0"), view("d1", inflight=5)]
    result = place(shape(), None, POOLS, instances, frozenset({("p0", "d1")}), frozenset(), 32)
    assert result.decode == "d1" and result.prefills == ("p0",)


@pytest.mark.parametrize("loads,warm,expected", [
    ((0, 0), set(), ("a", "b")),
    ((0, 0), {("b", "d")}, ("b", "a")),
    ((0, 1), {("b", "d")}, ("b", "a")),
    ((0, 5), {("b", "d")}, ("a", "b")),
], ids=["tie-by-name", "warm-wins-tie", "warm-beats-small-load-gap", "load-beats-warmth"])
def test_rank_prefills(loads, warm, expected):
    prefills = [view("a", "prefill", inflight=loads[0]), view("b", "prefill", inflight=loads[1]),
                view("c", "prefill", healthy=False)]
    compatible = frozenset({("a", "d"), ("b", "d"), ("c", "d")})
    assert rank_prefills(prefills, "d", compatible, frozenset(warm)) == expected


def test_mostly_cached_session_skips_prefill():
    """The P leg is skipped on what the decode instance reports it holds, not on the router's own record."""
    instances = [view("p0", "prefill"), view("d0")]
    session = SessionRecord("s", "tp-small", "d0", context_tokens=990, last_seen=0.0)
    pairs = frozenset({("p0", "d0")})
    held = {"d0": 990}
    assert not place(shape(prompt=1000), session, POOLS, instances, pairs, frozenset(), 32, held=held).disaggregate
    assert place(shape(prompt=1100), session, POOLS, instances, pairs, frozenset(), 32, held=held).disaggregate
    assert place(shape(prompt=1000), session, POOLS, instances, pairs, frozenset(), 32).disaggregate


@pytest.mark.parametrize("headers,body,expected", [
    ({"x-session-id": "abc"}, {"user": "u"}, "abc"),
    ({}, {"user": "u"}, "u"),
    ({}, {}, None),
    ({}, {"user": ""}, None),
    ({}, {"user": {"x": 1}}, None),
], ids=["header-wins", "user-field", "none", "empty-user", "bad-user"])
def test_session_id_of(headers, body, expected):
    assert session_id_of(headers, body) == expected


@pytest.mark.parametrize("body,expected", [
    ({"prompt": "abcdefgh"}, 3),
    ({"prompt": [1, 2, 3, 4, 5]}, 5),
    ({"prompt": [[1, 2], [1, 2, 3]]}, 3),
    ({"prompt": ["abcd", "abcd"]}, 4),
    ({"messages": [{"role": "user", "content": "abcdefgh"}]}, 7),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}, 6),
], ids=["text", "ids", "id-lists", "text-list", "chat", "chat-parts"])
def test_estimate_prompt_tokens(body, expected):
    assert estimate_prompt_tokens(body, chars_per_token=4.0) == expected


GROWN = SessionRecord("s", "tp-small", "d-s0", 40_000, 0.0)
"""A session of `tp-small` whose known context sends it to the `dcp` pool."""


@pytest.mark.parametrize("move_pairs,held,source", [
    (frozenset({("d-s0", "d-l0")}), {"d-s0": 30_000}, "d-s0"),
    (frozenset({("d-s0", "d-l0"), ("d-s1", "d-l0")}), {"d-s0": 900, "d-s1": 30_000}, "d-s1"),
    (frozenset(), {"d-s0": 30_000}, None),
    (frozenset({("d-s0", "d-l1")}), {"d-s0": 30_000}, None),
    (frozenset({("d-s0", "d-l0")}), {}, None),
    (frozenset({("d-b0", "d-l0")}), {"d-b0": 30_000}, None),
], ids=["holder-moves", "biggest-holder", "no-move-pair", "pair-to-another-decode", "nothing-held",
        "holder-outside-the-old-pool"])
def test_a_grown_session_moves_its_kv_from_the_instance_holding_it(move_pairs, held, source):
    """Session growth: the old pool's instance holding the most of the session, paired with the new decode
    instance, runs the P leg first (`move_source`); the usual prefills follow it as the fallback."""
    result = place(shape(prompt=100), GROWN, POOLS, INSTANCES, ALL_PAIRS, frozenset(), 32, held=held,
                   resumable={}, move_pairs=move_pairs)
    assert (result.pool, result.decode, result.is_migration) == ("dcp", "d-l0", True), result.reason
    assert result.move_source == source, result.reason
    assert result.disaggregate
    assert result.prefills == ((source,) if source else ()) + ("p0", "p1")


def test_a_session_that_stays_in_its_pool_moves_no_kv():
    result = place(shape(), SessionRecord("s", "tp-small", "d-s0", 500, 0.0), POOLS, INSTANCES, ALL_PAIRS,
                   frozenset(), 32, held={"d-s0": 500}, move_pairs=frozenset({("d-s0", "d-l0")}))
    assert not result.is_migration and result.move_source is None and "d-s0" not in result.prefills


def test_an_unusable_holder_is_no_move_source():
    instances = [view("d-s0", draining=True) if v.name == "d-s0" else v for v in INSTANCES]
    result = place(shape(prompt=100), GROWN, POOLS, instances, ALL_PAIRS, frozenset(), 32, held={"d-s0": 30_000},
                   move_pairs=frozenset({("d-s0", "d-l0")}))
    assert result.is_migration and result.move_source is None and result.prefills == ("p0", "p1")
