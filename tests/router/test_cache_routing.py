"""Routing by cache (docs/SESSIONS.md, router half): pure placement over what nodes hold, the cache view,
the byte-level prompt estimate, usage truth, and the router in front of fake nodes implementing the
contract (tests/router/session_fakes.py)."""

from __future__ import annotations

import asyncio
import functools

import httpx
import orjson
import pytest

from engine.model.tokenizer import ByteTokenizer, ChatMessage
from router.cache_view import MAX_SESSIONS, CachePoller, CacheReport, CacheView, parse_report
from router.config import PoolSpec
from router.placement import PoolView, RequestShape, SessionRecord, estimate_prompt_tokens_bytes, place, \
    rank_prefills
from router.session_routing import UsageRewriter, rewrite_usage
from tests.router.harness import router_harness
from tests.router.session_fakes import CacheNode
from tests.router.test_placement import view

POOLS = [PoolView("tp", "tp", 4_000), PoolView("dcp", "dcp", None)]
INSTANCES = [view("p0", "prefill", pool="any"), view("p1", "prefill", pool="any"),
             view("d0", pool="tp", inflight=5), view("d1", pool="tp"), view("l0", pool="dcp")]
PAIRS = frozenset((p, d) for p in ("p0", "p1") for d in ("d0", "d1", "l0"))


def shape(prompt: int, session: str | None = "s", max_tokens: int = 100) -> RequestShape:
    return RequestShape(session_id=session, prompt_tokens=prompt, max_tokens=max_tokens, expected_growth_tokens=0)


def put(prompt: int, held: dict[str, int], session: SessionRecord | None = None, min_uncached: int = 32):
    return place(shape(prompt), session, POOLS, INSTANCES, PAIRS, frozenset(), min_uncached, held=held)


# ---- pure placement ----------------------------------------------------------------------------------------

def test_turn_goes_to_the_decode_holding_its_prefix_over_a_less_loaded_one():
    result = put(1_000, {"d0": 900})
    assert (result.decode, result.cached_tokens_estimate) == ("d0", 900) and result.reason.startswith("holds")
    assert put(1_000, {}).decode == "d1", "without a holder: least loaded"


def test_cache_beats_a_stale_sticky_record():
    """The router's record says d1, the nodes say d0 holds the session: d0 (the record is only a fallback)."""
    result = put(1_000, {"d0": 900}, SessionRecord("s", "tp", "d1", 900, 0.0))
    assert result.decode == "d0"


def test_session_without_a_record_returns_to_the_pool_of_its_holder():
    """A session this router never saw (another replica served it) goes back to the instance holding it."""
    result = put(1_000, {"l0": 950})
    assert (result.pool, result.decode, result.is_migration) == ("dcp", "l0", False)


@pytest.mark.parametrize("prompt,held,disaggregate", [
    (1_000, 990, False), (1_000, 969, False), (1_000, 968, True), (1_000, 0, True), (1_000, 5_000, False),
], ids=["mostly-held", "just-under-min", "exactly-min-uncached", "nothing-held", "held-longer-than-prompt"])
def test_prefill_leg_skipped_only_when_the_decode_really_holds_enough(prompt, held, disaggregate):
    result = put(prompt, {"d1": held} if held else {})
    assert result.disaggregate is disaggregate
    assert result.cached_tokens_estimate == min(held, prompt)


def test_only_a_reported_resumable_prefix_skips_the_prefill_leg():
    """Held attention blocks route the turn; only a prefix the node can resume a local prefill from skips P."""
    result = place(shape(1_000), None, POOLS, INSTANCES, PAIRS, frozenset(), 32, held={"d0": 990}, resumable={})
    assert (result.decode, result.disaggregate, result.cached_tokens_estimate) == ("d0", True, 0)
    result = place(shape(1_000), None, POOLS, INSTANCES, PAIRS, frozenset(), 32, held={"d0": 990},
                   resumable={"d0": 980})
    assert (result.decode, result.disaggregate, result.cached_tokens_estimate) == ("d0", False, 980)


def test_what_another_decode_holds_does_not_skip_the_prefill_leg():
    """The chosen decode must hold it: a holder in the session's old pool does not count after a move."""
    result = put(5_000, {"d0": 4_500}, SessionRecord("s", "tp", "d0", 4_500, 0.0))
    assert (result.pool, result.decode, result.is_migration, result.disaggregate) == ("dcp", "l0", True, True)
    assert result.cached_tokens_estimate == 0, "the DCP pool receives the whole KV once"


def test_prefill_with_the_longest_cached_prefix_ranks_first():
    prefills = [view("p0", "prefill", inflight=0), view("p1", "prefill", inflight=4)]
    compatible = frozenset({("p0", "d"), ("p1", "d")})
    assert rank_prefills(prefills, "d", compatible, frozenset(), {"p1": 800, "p0": 100}) == ("p1", "p0")
    assert rank_prefills(prefills, "d", compatible, frozenset(), {}) == ("p0", "p1")
    assert put(1_000, {"p1": 700}).prefills[0] == "p1"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "héllo ✓"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]}]},
    {"messages": [{"role": "assistant", "content": ""}, {"role": "tool", "content": "{\"ok\": true}"}]},
], ids=["ascii-and-utf8", "content-parts", "empty-and-tool"])
def test_byte_estimate_equals_the_reference_tokenizer(body):
    def text(content):
        return content if isinstance(content, str) else "".join(p["text"] for p in content)

    ids = ByteTokenizer().apply_chat_template([ChatMessage(m["role"], text(m["content"])) for m in body["messages"]])
    assert estimate_prompt_tokens_bytes(body) == len(ids)


@pytest.mark.parametrize("prompt", ["héllo world", "x" * 300])
def test_byte_estimate_of_a_text_prompt(prompt):
    assert estimate_prompt_tokens_bytes({"prompt": prompt}) == len(ByteTokenizer().encode(prompt))
    assert estimate_prompt_tokens_bytes({"prompt": [1, 2, 3]}) == 3


# ---- the cache view ----------------------------------------------------------------------------------------

def test_parse_report_bounds_what_a_node_answers():
    sessions = {f"{i:032x}": i + 1 for i in range(MAX_SESSIONS + 50)}
    sessions.update({"not-hex": 5, "a" * 65: 5, "ab": -1, "cd": True})
    report = parse_report({"block_tokens": 16, "sessions": sessions, "queried_tokens": 10})
    assert len(report.sessions) == MAX_SESSIONS
    assert all(len(k) <= 64 and int(k, 16) >= 0 for k in report.sessions)
    assert parse_report({"sessions": []}) is None and parse_report([1]) is None


def test_poll_replaces_old_entries_but_keeps_notes_newer_than_the_poll():
    view_ = CacheView()
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={"aa": 100, "bb": 50}), sent_at=10.0)
    assert view_.held("aa") == {"d0": 100}
    view_.note_served("d0", "cc", 300, now=11.0)       # after the next poll was sent
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={"aa": 120}), sent_at=10.5)
    assert view_.held("aa") == {"d0": 120} and view_.held("bb") == {} and view_.held("cc") == {"d0": 300}
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={}), sent_at=12.0)  # evicted on the node
    assert view_.held("cc") == {} and view_.resumable("cc") == {}, "no tails reported: resumable is not noted"


def test_a_turn_end_is_resumable_at_once_only_on_a_node_with_tails():
    view_ = CacheView()
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={"aa": 1024}, resumable={"aa": 1024},
                                         tails=True), sent_at=10.0)
    view_.apply_report("d1", CacheReport(blocks_cached=1, sessions={"aa": 1024}, resumable={"aa": 1024}),
                       sent_at=10.0)
    view_.note_served("d0", "aa", 1300, now=11.0, resumable=1299)
    view_.note_served("d1", "aa", 1300, now=11.0, resumable=1299)
    assert view_.resumable("aa") == {"d0": 1299, "d1": 1024}
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={"aa": 1024}, resumable={"aa": 1024},
                                         tails=True), sent_at=10.5)  # sent before the turn ended: note kept
    assert view_.resumable("aa")["d0"] == 1299
    view_.apply_report("d0", CacheReport(blocks_cached=1, sessions={"aa": 1024}, resumable={"aa": 1024},
                                         tails=True), sent_at=12.0)  # the node's own word wins (tail evicted)
    assert view_.resumable("aa")["d0"] == 1024
    assert parse_report({"sessions": {}, "tails": True}).tails and not parse_report({"sessions": {}, "tails": 1}).tails


def test_resumable_defaults_to_sessions_when_a_node_reports_none():
    report = parse_report({"sessions": {"aa": 64}, "resumable": {"aa": 32}, "blocks_cached": 2})
    assert (report.sessions, report.resumable) == ({"aa": 64}, {"aa": 32})
    assert parse_report({"sessions": {"aa": 64}}).resumable == {"aa": 64}


def test_no_optimistic_entry_on_a_node_whose_cache_is_off():
    view_ = CacheView()
    view_.apply_report("d0", CacheReport(queried_tokens=500), sent_at=1.0)  # looks up, holds nothing: off
    view_.note_served("d0", "aa", 100, now=2.0)
    assert view_.held("aa") == {}
    view_.note_served("d9", "aa", 100, now=2.0)  # never reported: nothing assumed
    assert view_.held("aa") == {}


# ---- usage truth -------------------------------------------------------------------------------------------

def test_rewrite_usage_of_a_whole_answer():
    answer = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}})
    assert orjson.loads(rewrite_usage(answer, 7))["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert rewrite_usage(answer, None) is answer and rewrite_usage(b"not json", 3) == b"not json"


def test_usage_rewriter_handles_events_split_across_chunks():
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":9}}\n\n'
    chunks = [b'data: {"choices":[{"text":"a"}]}\n\n', usage[:17], usage[17:] + b"data: [DONE]\n\n"]
    rewriter = UsageRewriter(lambda: 5)
    out = b"".join(rewriter.feed(c) for c in chunks) + rewriter.flush()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == chunks[0].strip() and events[-1] == b"data: [DONE]"
    assert orjson.loads(events[1][5:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


# ---- the router in front of contract fakes -----------------------------------------------------------------

def sync(fn):
    """Run an async test body on its own event loop."""
    @functools.wraps(fn)
    def wrapper():
        return asyncio.run(fn())
    return wrapper


def nodes(cache_on: bool = True) -> list[CacheNode]:
    return [CacheNode("prefill-0", "prefill", cache_on), CacheNode("prefill-1", "prefill", cache_on),
            CacheNode("decode-0", "decode", cache_on), CacheNode("decode-1", "decode", cache_on)]


def chat_body(messages: list[dict], **extra) -> dict:
    return {"model": "fake-model", "messages": messages, "max_tokens": 4, **extra}


async def poll(app) -> None:
    state = app.state.router
    await CachePoller(state.registry, state.cache_view, state.client, 1.0, 5.0).poll_all()


SETTINGS = {"prompt_estimate": "bytes", "disagg_min_uncached_tokens": 32, "cache_poll_interval_s": 3600.0}


@sync
async def test_session_turns_follow_the_cache_and_report_the_prefill_legs_cached_tokens():
    fakes = nodes()
    async with router_harness(fakes, **{**SETTINGS, "disagg_min_uncached_tokens": 64}) as (client, app):
        await poll(app)
        messages = [{"role": "system", "content": "S" * 400}, {"role": "user", "content": "task " * 40}]
        first = await client.post("/v1/chat/completions", json=chat_body(messages),
                                  headers={"X-Session-ID": "agent-1"})
        assert first.status_code == 200 and first.headers["x-pdcluster-prefill"] != "none"
        decode, prefill = first.headers["x-pdcluster-decode"], first.headers["x-pdcluster-prefill"]
        await poll(app)
        messages += [{"role": "assistant", "content": "t0 t1 t2 t3 "}, {"role": "tool", "content": "R" * 200}]
        second = await client.post("/v1/chat/completions", json=chat_body(messages),
                                   headers={"X-Session-ID": "agent-1"})
        assert second.headers["x-pdcluster-decode"] == decode and second.headers["x-pdcluster-prefill"] == prefill
        by_name = {n.name: n for n in fakes}
        p_cached = by_name[prefill].requests[-1]["cached"]
        d_cached = by_name[decode].requests[-1]["cached"]
        assert 0 < p_cached < d_cached, "prefill holds the last prompt, decode the prompt and the answer"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == p_cached
        # a short follow-up the decode instance reports it can resume almost all of: no P leg, the decode's figure
        await poll(app)
        messages += [{"role": "assistant", "content": "t0 t1 t2 t3 "}, {"role": "user", "content": "ok"}]
        third = await client.post("/v1/chat/completions", json=chat_body(messages, stream=True,
                                  stream_options={"include_usage": True}), headers={"X-Session-ID": "agent-1"})
        assert third.headers["x-pdcluster-prefill"] == "none" and third.headers["x-pdcluster-decode"] == decode
        usage = [orjson.loads(line[5:]) for line in third.text.split("\n\n") if '"usage"' in line][0]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == by_name[decode].requests[-1]["cached"] > 0
        metrics = (await client.get("/metrics")).text
        assert 'pdcluster_prefill_skipped_total{pool="default"} 1.0' in metrics
        cached_total = p_cached + usage["prompt_tokens_details"]["cached_tokens"]
        assert f'pdcluster_cached_prompt_tokens_total{{pool="default"}} {float(cached_total)}' in metrics


@sync
async def test_streamed_pd_usage_is_the_prefill_legs():
    fakes = nodes()
    async with router_harness(fakes, **SETTINGS) as (client, app):
        await poll(app)
        messages = [{"role": "user", "content": "x" * 300}]
        for _ in range(2):
            body = chat_body(messages, stream=True, stream_options={"include_usage": True})
            resp = await client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "s2"})
            await poll(app)
            messages += [{"role": "assistant", "content": "t0 t1 t2 t3 "}, {"role": "user", "content": "y" * 100}]
        prefill = next(n for n in fakes if n.name == resp.headers["x-pdcluster-prefill"])
        usage = [orjson.loads(e[5:]) for e in resp.text.split("\n\n") if '"usage"' in e][0]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == prefill.requests[-1]["cached"] > 0
        assert resp.text.endswith("data: [DONE]\n\n")


@sync
async def test_with_the_node_cache_off_every_turn_runs_both_legs_and_reports_nothing_cached():
    fakes = nodes(cache_on=False)
    async with router_harness(fakes, **SETTINGS) as (client, app):
        messages = [{"role": "user", "content": "q" * 300}]
        for turn in range(3):
            await poll(app)
            resp = await client.post("/v1/chat/completions", json=chat_body(messages),
                                     headers={"X-Session-ID": "off"})
            assert resp.headers["x-pdcluster-prefill"] != "none", f"turn {turn}"
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            messages += [{"role": "assistant", "content": "t0 t1 t2 t3 "}, {"role": "user", "content": "more"}]


@sync
async def test_nodes_see_only_the_hashed_tenant_scoped_key():
    fakes = nodes()
    async with router_harness(fakes, api_keys="key-a,key-b", **SETTINGS) as (client, app):
        keys = []
        for api_key in ("key-a", "key-b", "key-a"):
            resp = await client.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}]),
                                     headers={"X-Session-ID": "same-id", "Authorization": f"Bearer {api_key}"})
            assert resp.status_code == 200
            decode = next(n for n in fakes if n.name == resp.headers["x-pdcluster-decode"])
            keys.append(decode.requests[-1]["session"])
        assert keys[0] == keys[2] != keys[1], "same id under two API keys: two sessions"
        assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
        seen = [r["session"] for n in fakes for r in n.requests]
        assert "same-id" not in seen and all(s in keys for s in seen), "the raw id never reaches a node"


@sync
async def test_both_legs_carry_the_tenants_cache_scope_never_its_key():
    """Each API key's requests carry one prefix-cache scope on both legs (the node salts its cache with it, so
    another tenant never hits, nor sees in cached_tokens, a prefix it did not send); without keys none is sent."""
    fakes = nodes()
    prompt = [{"role": "user", "content": "p" * 300}]
    async with router_harness(fakes, api_keys="key-a,key-b", **SETTINGS) as (client, _):
        scopes = []
        for api_key in ("key-a", "key-b", "key-a"):
            resp = await client.post("/v1/chat/completions", json=chat_body(prompt),
                                     headers={"Authorization": f"Bearer {api_key}"})
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] != "none"
            legs = [r["tenant"] for n in fakes for r in n.requests]
            assert len(legs) == 2 and legs[0] == legs[1], "the P and the D leg name the same scope"
            scopes.append(legs[0])
            for node in fakes:
                node.requests.clear()
        assert scopes[0] == scopes[2] != scopes[1]
        assert all(len(s) == 32 and int(s, 16) >= 0 for s in scopes)
        assert not {"key-a", "key-b"} & set(scopes)
    fakes = nodes()
    async with router_harness(fakes, **SETTINGS) as (client, _):
        assert (await client.post("/v1/chat/completions", json=chat_body(prompt))).status_code == 200
        assert [r["tenant"] for n in fakes for r in n.requests] == [None, None]


@sync
async def test_user_field_is_a_session_too():
    fakes = nodes()
    async with router_harness(fakes, **SETTINGS) as (client, _):
        resp = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 2,
                                                          "user": "u-1"})
        assert resp.status_code == 200
        assert all(r["session"] for n in fakes for r in n.requests)


@sync
async def test_cache_poll_survives_a_node_without_the_endpoint():
    fakes = nodes()
    async with router_harness(fakes, **SETTINGS) as (client, app):
        state, view_ = app.state.router, CacheView()
        view_.apply_report("decode-0", CacheReport(queried_tokens=1, sessions={"aa": 5}), sent_at=0.0)
        answers = iter([httpx.Response(404), httpx.Response(200, content=b"[]"), httpx.Response(200, content=b"{")])
        poller = CachePoller(state.registry, view_, httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: next(answers, httpx.Response(500)))), 1.0, 1.0)
        await poller.poll_all()
        assert view_.reports() == {} and view_.held("aa") == {}


@sync
async def test_a_node_without_the_cache_endpoint_is_not_polled_every_round():
    """vLLM answers 404 to /v1/cache: the poller stops asking it every round (and asks again after a while, or
    when it comes back from unhealthy)."""
    fakes = nodes()
    async with router_harness(fakes, **SETTINGS) as (client, app):
        state, asked = app.state.router, []

        def answer(request: httpx.Request) -> httpx.Response:
            asked.append(request.url.host)
            return httpx.Response(404)
        poller = CachePoller(state.registry, CacheView(), httpx.AsyncClient(transport=httpx.MockTransport(answer)),
                             1.0, 1.0)
        for state_ in state.registry.states():
            state_.is_healthy = True
        healthy = len(state.registry.states())
        for _ in range(5):
            await poller.poll_all()
        assert len(asked) == healthy  # one 404 each, then no more
        decode = state.registry.get("decode-0")
        decode.is_healthy = False
        await poller.poll_all()
        decode.is_healthy = True
        await poller.poll_all()
        assert len(asked) == healthy + 1  # back from unhealthy: asked again


def test_a_report_names_the_nodes_engine_id_only_in_an_engine_ids_shape():
    assert parse_report({"sessions": {}, "engine_id": "0a1b-c.d_e"}).engine_id == "0a1b-c.d_e"
    for bad in ("", "../x", "a" * 200, 7, None):
        assert parse_report({"sessions": {}, "engine_id": bad}).engine_id is None
    view_ = CacheView()
    view_.apply_report("d0", CacheReport(engine_id="e0", sessions={"aa": 5}), sent_at=0.0)
    view_.forget_engine_id("d0")
    assert view_.engine_id("d0") is None and view_.held("aa") == {"d0": 5}, "only the id is forgotten"


@sync
async def test_the_prefill_leg_names_the_chosen_decode_instance_as_the_reader():
    """Once the router read a decode instance's engine id (its signed /v1/cache), the P leg asks for a hand-off
    bound to it, and the D leg carries that hand-off; before any report, and after the instance was unhealthy
    (a restart changes its id), the P leg names no reader rather than a stale one."""
    fakes = nodes(cache_on=False)
    async with router_harness(fakes, **SETTINGS) as (client, app):
        prompt = [{"role": "user", "content": "b" * 300}]

        async def legs() -> tuple[dict, dict, str]:
            for node in fakes:
                node.requests.clear()
            resp = await client.post("/v1/chat/completions", json=chat_body(prompt))
            assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] != "none"
            p_leg, d_leg = (next(r["body"]["kv_transfer_params"] for n in fakes for r in n.requests
                                 if n.role == role) for role in ("prefill", "decode"))
            return p_leg, d_leg, resp.headers["x-pdcluster-decode"]

        await poll(app)
        decodes = set()
        for _ in range(4):
            p_leg, d_leg, decode = await legs()
            assert p_leg["decode_engine_id"] == d_leg["decode_engine_id"] == f"engine-{decode}"
            decodes.add(decode)
        state = app.state.router
        for name in decodes:
            state.registry.get(name).is_healthy = False
        await poll(app)
        for name in decodes:
            state.registry.get(name).is_healthy = True
        p_leg, _, _ = await legs()
        assert "decode_engine_id" not in p_leg, "an instance that was unhealthy is not named until polled again"
