"""A session's turns through real nodes (P at TP=2 -> D at TP=1 and DCP=2, real NIXL): from
the second turn on, the prefill node computes only what its cache lacks and the decode node reads only the blocks
it does not hold; `cached_tokens` says so on both legs, /v1/cache and the metrics agree, and every answer equals
`pdcluster generate --prompt-ids` (the single-rank oracle without a cache: tests/oracle.py) token for token."""

from __future__ import annotations

import httpx
import pytest

from tests.decode_node.test_pd_nodes import _idle, _metric
from tests.oracle import generate
from tests.topologies import LONG_POOL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
MAX_TOKENS = 8
BLOCK = 1024  # D's block at TP=1 and at DCP=2; P's (TP=2) is 512


def _ids(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt) % 251 for i in range(n)]


@pytest.fixture(scope="module")
def nodes(cluster):
    """The shared cluster's nodes (tests/topologies.py), addressed directly. (Chunked prefill over rank groups with
    the prefix cache: tests/engine/test_prefix_cache_ranks.py.)"""
    return {"prefill": cluster.nodes_of(role="prefill")[0].url, "tp1": cluster.nodes_of(pool="tp")[0].url,
            "dcp2": cluster.nodes_of(pool=LONG_POOL)[0].url, "auth": cluster.control_auth}


def _oracle(prompt_ids: list[int]) -> list[int]:
    return generate(prompt_ids, MAX_TOKENS, ignore_eos=True)["token_ids"]


def _turn(p_url: str, d_url: str, prompt: list[int], session: str, request_id: str) -> tuple[dict, dict]:
    headers = {"x-pdcluster-session": session, "X-Request-Id": request_id}
    first = httpx.post(f"{p_url}/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": 1, "stream": False, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    second = httpx.post(f"{d_url}/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": first.json()["kv_transfer_params"]})
    assert second.status_code == 200, second.text
    return first.json(), second.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("pool", ["tp1", "dcp2"])
def test_session_turns_reuse_both_sides_and_equal_the_oracle(nodes, pool):
    p_url, d_url = nodes["prefill"], nodes[pool]
    session = {"tp1": "a1b2", "dcp2": "c3d4"}[pool]
    salt = {"tp1": 1, "dcp2": 2}[pool]
    reads0, reused0 = (_metric(d_url, "pdcluster_kv_transfer_blocks_total", f'kind="{k}"') for k in ("read", "reused"))
    prompt = [256] + _ids(1099, salt)
    p1, d1 = _turn(p_url, d_url, prompt, session, f"{pool}-t1")
    assert _cached(p1) == 0 and _cached(d1) == 0
    answer = d1["choices"][0]["token_ids"]
    assert answer == _oracle(prompt)
    # turn 2: the conversation so far plus a tool result
    prompt2 = prompt + answer + _ids(50, salt + 10)
    p2, d2 = _turn(p_url, d_url, prompt2, session, f"{pool}-t2")
    assert _cached(p2) == 1024  # P (512-token blocks) resumes at the first prompt's last block boundary
    assert _cached(d2) == BLOCK  # D holds turn 1's first block: it read the rest only
    assert d2["choices"][0]["token_ids"] == _oracle(prompt2)
    reads = _metric(d_url, "pdcluster_kv_transfer_blocks_total", 'kind="read"') - reads0
    reused = _metric(d_url, "pdcluster_kv_transfer_blocks_total", 'kind="reused"') - reused0
    assert (reads, reused) == (2 + 1, 1)  # turn 1: 2 blocks read; turn 2: 1 read, 1 reused
    view = httpx.get(f"{d_url}/v1/cache", auth=nodes["auth"]).json()
    assert view["block_tokens"] == BLOCK and view["sessions"][session] >= BLOCK
    assert view["hits_tokens"] >= BLOCK and view["queried_tokens"] >= len(prompt) + len(prompt2)
    assert httpx.get(f"{p_url}/v1/cache", auth=nodes["auth"]).json()["sessions"][session] >= 1024
    assert _metric(d_url, "pdcluster_prefix_cache_hit_tokens_total") >= BLOCK
    assert _metric(d_url, "pdcluster_prefix_cache_blocks") >= 1
    for url in (p_url, d_url):
        _idle(url, timeout_s=60)  # cached blocks count as free rows; the leases ended


def test_bad_session_header_is_a_400(nodes):
    for value in ("not-hex!", "a" * 65, ""):
        resp = httpx.post(f"{nodes['tp1']}/v1/completions", headers={"x-pdcluster-session": value}, timeout=60,
                          json={"prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 400, (value, resp.text)
        assert resp.json()["error"]["param"] == "x-pdcluster-session"
