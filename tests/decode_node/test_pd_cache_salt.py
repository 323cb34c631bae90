"""Tenant isolation of the prefix cache through real nodes (the shared cluster's P TP=2 -> D TP=1, real NIXL): the
router names each API key's scope in `x-pdcluster-tenant` on both legs (tests/router/test_cache_routing.py), and a
request's `cache_salt` narrows it further. Tenant B sending tenant A's prompt computes and reads everything
(cached_tokens 0 on both legs, the session report shows none of A's blocks), while A's next turn still hits; every
answer equals the oracle."""

from __future__ import annotations

import httpx
import pytest

from tests.decode_node.test_pd_sessions import _cached, _ids, _oracle, nodes  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
MAX_TOKENS = 8
TENANT_A, TENANT_B = "a" * 32, "b" * 32


def _turn(p_url: str, d_url: str, prompt: list[int], headers: dict, request_id: str, **extra) -> tuple[dict, dict]:
    headers = {**headers, "X-Request-Id": request_id}
    first = httpx.post(f"{p_url}/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True},
        **extra})
    assert first.status_code == 200, first.text
    second = httpx.post(f"{d_url}/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": first.json()["kv_transfer_params"], **extra})
    assert second.status_code == 200, second.text
    return first.json(), second.json()


def test_another_tenant_reuses_nothing_of_a_prefix_and_the_same_tenant_hits(nodes):  # noqa: F811
    p_url, d_url = nodes["prefill"], nodes["tp1"]
    prompt = [256] + _ids(1099, 41)
    a1 = _turn(p_url, d_url, prompt, {"x-pdcluster-tenant": TENANT_A, "x-pdcluster-session": "a5"}, "salt-a1")
    assert _cached(a1[0]) == 0 and _cached(a1[1]) == 0
    answer = a1[1]["choices"][0]["token_ids"]
    assert answer == _oracle(prompt)
    prompt2 = prompt + answer + _ids(40, 42)
    b = _turn(p_url, d_url, prompt2, {"x-pdcluster-tenant": TENANT_B, "x-pdcluster-session": "b5"}, "salt-b")
    assert (_cached(b[0]), _cached(b[1])) == (0, 0), "tenant B learns nothing of tenant A's prefix"
    assert b[1]["choices"][0]["token_ids"] == _oracle(prompt2)
    salted = _turn(p_url, d_url, prompt2, {"x-pdcluster-tenant": TENANT_A}, "salt-c", cache_salt="other")
    assert (_cached(salted[0]), _cached(salted[1])) == (0, 0), "a cache_salt of its own: no hit either"
    unscoped = _turn(p_url, d_url, prompt2, {}, "salt-u")
    assert (_cached(unscoped[0]), _cached(unscoped[1])) == (0, 0)
    a2 = _turn(p_url, d_url, prompt2, {"x-pdcluster-tenant": TENANT_A, "x-pdcluster-session": "a5"}, "salt-a2")
    assert _cached(a2[0]) == 1024 and _cached(a2[1]) == 1024, "tenant A still hits its own prefix"
    assert a2[1]["choices"][0]["token_ids"] == _oracle(prompt2)
    view = httpx.get(f"{d_url}/v1/cache", auth=nodes["auth"]).json()
    assert view["sessions"]["a5"] >= 1024
