"""Agent sessions keep their KV (issue 17 acceptance, docs/SESSIONS.md), through `pdcluster up`.

A 6-turn session with the official openai client and `X-Session-ID`; each turn appends the assistant's answer,
a tool result and a user message. Checked on every turn:
- the answer equals the same conversation computed from scratch (`pdcluster generate --prompt-ids` code, the
  uncached oracle), token for token, including the turn where the session moves from the `tp` pool to the DCP
  pool (its projected context passes TP_POOL_CAPACITY);
- turns 2-6 report `usage.prompt_tokens_details.cached_tokens` > 0, equal to the reused prefix: every turn
  runs a P leg here (each appends far more than `disagg_min_uncached_tokens`), so the client sees the P leg's
  figure. On the prefill node it reuses exactly the full blocks of the last prompt it prefilled for the session
  (its KV cache holds them, with the KDA snapshot at the prompt's last block boundary), i.e.
  floor(that prompt's tokens / block_tokens) * block_tokens, with block_tokens from its `GET /v1/cache`;
  that node's `/v1/cache` reports the same figure for the session before the turn;
- the turn that moves the session to the DCP pool runs its P leg on the `tp` decode instance holding it (its KV
  moves decode-to-decode: docs/ARCHITECTURE.md "Moving a session"), which reuses at least the full blocks of the
  previous prompt;
- the decode nodes reused blocks they held instead of reading them (`pdcluster_kv_transfer_blocks_total`).
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from router.identity import ANONYMOUS, session_key
from tests.topologies import LONG_POOL, SESSION_GROWTH_TOKENS, TP_POOL_CAPACITY

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
NUM_TURNS = 6
WORDS = ("tool call result file diff test build error trace patch review agent plan step context cache "
         "decode prefill router pool shard rank").split()


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _cache(url: str, auth) -> dict:
    resp = httpx.get(f"{url}/v1/cache", timeout=10, auth=auth)
    resp.raise_for_status()
    return resp.json()


def _reused_blocks(cluster) -> float:
    return sum(cluster.metrics(n.name).get("pdcluster_kv_transfer_blocks_total", kind="reused") or 0.0
               for n in cluster.nodes_of(role="decode"))


def test_six_turn_session_reuses_its_prefix_and_matches_the_uncached_answers(cluster):
    rng = random.Random(17)
    session = f"kv-session-{uuid.uuid4().hex[:12]}"
    key = session_key(ANONYMOUS, {"x-session-id": session}, {})  # what the router forwards to the nodes
    prefill_urls = {n.name: n.url for n in cluster.nodes_of(role="prefill")}
    tp_decode = cluster.nodes_of(role="decode", pool="tp")[0]
    tp_block = _cache(tp_decode.url, cluster.control_auth)["block_tokens"]
    client = cluster.client()
    # a system prompt no other test sends: turn 1 cannot hit another session's blocks
    messages = [{"role": "system", "content": f"You are coding agent {session}. {_text(rng, 60)}"},
                {"role": "user", "content": f"task: {_text(rng, 40)}"}]
    reused_before = _reused_blocks(cluster)
    pools, previous_prompt, prefilled_prompt, num_moves = [], None, None, 0
    for turn in range(1, NUM_TURNS + 1):
        expected = cluster.oracle_chat(messages, MAX_TOKENS)
        reported = {name: _cache(url, cluster.control_auth) for name, url in prefill_urls.items()}
        raw = client.chat.completions.with_raw_response.create(
            model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_headers={"X-Session-ID": session})
        reply = raw.parse()
        pool, prefill = raw.headers["x-pdcluster-pool"], raw.headers["x-pdcluster-prefill"]
        pools.append(pool)
        where = f"turn {turn} (pool {pool}, prefill {prefill})"
        assert reply.choices[0].message.content == expected.text, where
        assert reply.usage.completion_tokens == len(expected.token_ids), where
        assert prefill != "none", f"{where}: every turn appends enough to run a P leg"
        details = reply.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        if prefill not in prefill_urls:  # the session outgrows `tp`: its KV moves from the tp instance
            assert prefill == tp_decode.name and pool == LONG_POOL and pools[-2:-1] == ["tp"], where
            num_moves += 1
            floor = previous_prompt // tp_block * tp_block
            assert cached is not None and floor <= cached < reply.usage.prompt_tokens, \
                f"{where}: cached {cached}, the previous prompt had {previous_prompt} tokens"
        elif turn >= 2:
            block = reported[prefill]["block_tokens"]
            reused = prefilled_prompt // block * block
            assert cached is not None and cached > 0, f"{where}: cached_tokens {cached}"
            assert cached == reused, f"{where}: cached {cached}, the last prompt it prefilled ({prefilled_prompt} " \
                                     f"tokens) holds {reused} in full {block}-token blocks"
            assert reported[prefill]["resumable"].get(key, reported[prefill]["sessions"].get(key)) == reused, \
                f"{where}: /v1/cache of {prefill} before the turn"
        previous_prompt = reply.usage.prompt_tokens
        if prefill in prefill_urls:
            prefilled_prompt = previous_prompt
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "tool", "content": f"result {turn}: {_text(rng, 30)}"},
                     {"role": "user", "content": f"turn {turn}: {_text(rng, 25)}"}]
    assert previous_prompt + MAX_TOKENS + SESSION_GROWTH_TOKENS > TP_POOL_CAPACITY  # the session outgrew `tp`
    assert pools[0] == "tp" and pools[-1] == LONG_POOL, pools
    assert pools == sorted(pools, key=lambda p: p == LONG_POOL), f"the session moved back: {pools}"
    assert num_moves == 1, "the session's KV moved decode-to-decode once"
    assert _reused_blocks(cluster) > reused_before, "decode nodes reused held blocks instead of reading them"
