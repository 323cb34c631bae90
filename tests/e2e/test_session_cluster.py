"""A 5-turn agent session whose context grows past the `tp` pool's capacity moves to the long-session pool and
keeps producing oracle tokens. The pool of each turn is read from the router's requests counter."""

from __future__ import annotations

import random

import pytest

from tests.topologies import LONG_POOL, SESSION_GROWTH_TOKENS, TP_POOL_CAPACITY

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
WORDS = ("tool call result file diff test build error trace patch review agent plan step context cache "
         "decode prefill router pool shard rank").split()


def _user_turn(rng: random.Random, turn: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(70))
    return f"turn {turn}: {body}"[:400]


def _ok_by_pool(cluster) -> dict[str, float]:
    metrics = cluster.metrics("router")
    return {pool: metrics.get("pdcluster_requests_total", outcome="ok", pool=pool) or 0.0 for pool in ("tp", LONG_POOL)}


def test_session_moves_from_tp_to_long_pool_and_matches_oracle(cluster):
    rng = random.Random(7)
    client = cluster.client()
    messages = [{"role": "system", "content": "You are a coding agent."}]
    pools = []
    for turn in range(5):
        messages.append({"role": "user", "content": _user_turn(rng, turn)})
        expected = cluster.oracle_chat(messages, MAX_TOKENS)
        before = _ok_by_pool(cluster)
        reply = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_headers={"X-Session-ID": "agent-session-1"})
        after = _ok_by_pool(cluster)
        served = [pool for pool in after if after[pool] == before[pool] + 1]
        assert len(served) == 1, f"turn {turn}: ok counters moved {before} -> {after}"
        pools.append(served[0])
        assert reply.choices[0].message.content == expected.text, f"turn {turn} on pool {served[0]}"
        assert reply.usage.completion_tokens == len(expected.token_ids), f"turn {turn} on pool {served[0]}"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    context = sum(len(m["content"]) for m in messages)
    assert context + MAX_TOKENS + SESSION_GROWTH_TOKENS > TP_POOL_CAPACITY  # the test really outgrows `tp`
    assert pools[0] == "tp" and pools[-1] == LONG_POOL, pools
    assert pools == sorted(pools, key=lambda p: p == LONG_POOL), f"the session moved back: {pools}"


def test_a_turn_the_decode_instance_holds_skips_its_prefill_leg_and_matches_oracle(cluster):
    """Conditional disaggregation on the real cluster: a turn whose whole prompt the session's decode instance
    reports it can resume (here the same conversation sent again, as a client retry does) skips the P leg
    (`x-pdcluster-prefill: none`, `pdcluster_prefill_skipped_total`) and still answers the oracle's tokens."""
    client = cluster.client()
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "turn 0: " + " ".join(WORDS) * 3}]
    expected = cluster.oracle_chat(messages, MAX_TOKENS)
    headers = {"X-Session-ID": "conditional-disagg-1"}
    first = client.chat.completions.with_raw_response.create(model=cluster.model, messages=messages,
                                                             max_tokens=MAX_TOKENS, temperature=0,
                                                             extra_headers=headers)
    assert first.headers["x-pdcluster-prefill"] != "none"  # the first turn runs its P leg
    assert first.parse().choices[0].message.content == expected.text
    skipped_before = cluster.metrics("router").get("pdcluster_prefill_skipped_total") or 0.0

    def again_without_prefill_leg() -> bool:
        reply = client.chat.completions.with_raw_response.create(model=cluster.model, messages=messages,
                                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                                 extra_headers=headers)
        assert reply.parse().choices[0].message.content == expected.text  # with or without a P leg
        return reply.headers["x-pdcluster-prefill"] == "none"
    # the router learns what the decode instance holds from its next `/v1/cache` poll (every second)
    cluster.wait_until(again_without_prefill_leg, 30, "a turn without a P leg", poll_s=1.0)
    assert cluster.metrics("router").value("pdcluster_prefill_skipped_total") >= skipped_before + 1


def test_session_growth_moves_its_kv_from_the_tp_instance_to_the_long_pool(cluster):
    """Session growth moves KV decode-to-decode (router/placement.py `move_source`): the first turn that outgrows
    `tp` sends its P leg to the `tp` decode instance holding the session, which prefills only the new turn's tokens
    on top of its prefix cache and leases the whole prompt's rows; the long pool's instance READs them
    (`pdcluster_kv_moved_*` on it) and answers the oracle's tokens. The prefill node exports nothing for it."""
    rng = random.Random(31)
    client = cluster.client()
    source = cluster.nodes_of(role="decode", pool="tp")[0].name
    reader = cluster.nodes_of(role="decode", pool=LONG_POOL)[0].name
    prefill = cluster.nodes_of(role="prefill")[0].name
    messages = [{"role": "system", "content": "You are a reviewing agent."}]
    previous_prompt = 0
    for turn in range(8):
        messages.append({"role": "user", "content": _user_turn(rng, turn)})
        expected = cluster.oracle_chat(messages, MAX_TOKENS)
        router_before = cluster.metrics("router")
        reader_before, exported_before = cluster.metrics(reader), cluster.metrics(prefill)
        raw = client.chat.completions.with_raw_response.create(
            model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_headers={"X-Session-ID": "kv-move-session-1"})
        reply = raw.parse()
        assert reply.choices[0].message.content == expected.text, f"turn {turn} on {raw.headers['x-pdcluster-pool']}"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if raw.headers["x-pdcluster-pool"] == "tp":
            previous_prompt = reply.usage.prompt_tokens
            continue
        assert turn > 0, "the session started on the long pool"
        assert raw.headers["x-pdcluster-decode"] == reader and raw.headers.get("x-pdcluster-migrated") == "true"
        assert raw.headers["x-pdcluster-prefill"] == source  # the P leg ran on the instance holding the session
        router_after, reader_after = cluster.metrics("router"), cluster.metrics(reader)
        assert router_after.value("pdcluster_migrations_total", reason="session_growth") == \
            (router_before.get("pdcluster_migrations_total", reason="session_growth") or 0.0) + 1
        # the long pool's instance READ the session's rows and KDA state from the tp instance, once
        assert reader_after.value("pdcluster_kv_moved_requests_total") == \
            (reader_before.get("pdcluster_kv_moved_requests_total") or 0.0) + 1
        moved_bytes = reader_after.value("pdcluster_kv_moved_bytes_total") - \
            (reader_before.get("pdcluster_kv_moved_bytes_total") or 0.0)
        assert moved_bytes > 0
        assert cluster.metrics(prefill).value("pdcluster_node_rows_exported_total") == \
            exported_before.value("pdcluster_node_rows_exported_total")  # no P leg on the prefill node
        # only the new turn's tokens were prefilled (what this prompt adds to the last one the tp instance saw: the
        # previous answer as the client sends it back and the new user message); the rest came from its cache
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert previous_prompt <= cached < reply.usage.prompt_tokens, (cached, previous_prompt)
        print(f"session moved {source} -> {reader} at turn {turn}: {moved_bytes:.0f} bytes READ, "
              f"{reply.usage.prompt_tokens - cached} of {reply.usage.prompt_tokens} prompt tokens prefilled")
        return
    pytest.fail("the session never outgrew the tp pool")
