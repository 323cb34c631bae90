"""A hand-off is redeemed once, by the reader it was issued for, with real nodes (the shared `cluster`: P at
TP=2 -> D `tp` and D `dcp`, real NIXL): the same signed params presented at once to both decode nodes and twice to
one of them import exactly once (the prefill node's claim: first wins, the rest 409/403) and every row comes back;
params issued for one decode node are refused by the other (and the reader field cannot be rewritten: signed);
through the router, every hand-off is bound to the decode instance the router chose."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.decode_node.test_pd_nodes import _idle, _metric
from tests.e2e.harness import choice_token_ids
from tests.topologies import ADMIN_TOKEN, LONG_POOL, TP_POOL_CAPACITY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
PROMPT = "A hand-off is read once, by its reader. " * 8


@pytest.fixture(scope="module")
def nodes(cluster):
    return {"prefill": cluster.nodes_of(role="prefill")[0].url, "tp": cluster.nodes_of(pool="tp")[0].url,
            "dcp": cluster.nodes_of(pool=LONG_POOL)[0].url, "auth": cluster.control_auth}


def _notified(p_url: str) -> float:
    """Leases the prefill node ended by their readers' DONEs (0 before the first: the series starts then)."""
    try:
        return _metric(p_url, "pdcluster_node_lease_outcomes_total", 'outcome="notified"')
    except AssertionError:
        return 0.0


def _export(p_url: str, request_id: str, **params) -> dict:
    resp = httpx.post(f"{p_url}/v1/completions", headers={"X-Request-Id": request_id}, timeout=600, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True,
                                                                                  **params}})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _decode(d_url: str, params: dict, request_id: str) -> httpx.Response:
    return httpx.post(f"{d_url}/v1/completions", headers={"X-Request-Id": request_id}, timeout=600,
                      json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "kv_transfer_params": params})


def test_concurrent_presentations_on_two_decode_nodes_import_once(nodes):
    p_url = nodes["prefill"]
    notified0 = _notified(p_url)
    params = _export(p_url, "once-1")
    targets = [nodes["tp"], nodes["dcp"], nodes["tp"]]
    with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
        answers = list(pool.map(lambda t: _decode(t[1], params, f"once-1-{t[0]}"), enumerate(targets)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(200) == 1, [a.text for a in answers]
    for refused in (a for a in answers if a.status_code != 200):
        assert refused.status_code in (403, 409), refused.text
        message = refused.json()["error"]["message"]
        assert "already" in message and params["lease_id"] not in message
    winner = next(a for a in answers if a.status_code == 200).json()
    assert winner["usage"]["completion_tokens"] == 4
    for url in (nodes["tp"], nodes["dcp"], p_url):
        _idle(url, timeout_s=120)
    assert _notified(p_url) == notified0 + 1


def test_a_handoff_issued_for_one_decode_node_is_refused_by_another(nodes):
    p_url, auth = nodes["prefill"], nodes["auth"]
    reader = httpx.get(f"{nodes['tp']}/v1/cache", auth=auth, timeout=30).json()["engine_id"]
    params = _export(p_url, "bound-1", decode_engine_id=reader)
    assert params["decode_engine_id"] == reader
    refused = _decode(nodes["dcp"], params, "bound-1-dcp")
    assert refused.status_code == 403 and "another decode instance" in refused.json()["error"]["message"]
    rewritten = _decode(nodes["dcp"], {**params, "decode_engine_id": None}, "bound-1-rewritten")
    assert rewritten.status_code == 403 and "signature" in rewritten.json()["error"]["message"]
    accepted = _decode(nodes["tp"], params, "bound-1-tp")
    assert accepted.status_code == 200, accepted.text
    for url in (nodes["tp"], nodes["dcp"], p_url):
        _idle(url, timeout_s=120)


def _issued(p_url: str, reader: str) -> float:
    try:
        return _metric(p_url, "pdcluster_node_handoffs_issued_total", f'reader="{reader}"')
    except AssertionError:  # the series starts with the first hand-off of its kind
        return 0.0


@pytest.mark.parametrize("pool", ("tp", LONG_POOL))
def test_the_router_binds_each_handoff_to_the_decode_instance_it_chose(cluster, nodes, pool):
    """Through the router, on each P -> D pairing: the P leg names the chosen decode instance as the reader (its
    engine id, read from its signed `/v1/cache`), so the hand-off is bound (P counts it `bound`, none `any`), and
    the answer is the oracle's. Before the router named the reader, every hand-off it asked for was `any`."""
    p_url, auth = nodes["prefill"], nodes["auth"]
    engine_id = httpx.get(f"{nodes[pool]}/v1/cache", auth=auth, timeout=30).json()["engine_id"]
    decode = cluster.nodes_of(pool=pool)[0].name

    def router_knows_the_reader() -> bool:
        pools = httpx.get(f"{cluster.router_url}/v1/pools", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                          timeout=10).json()
        return any(i["name"] == decode and i["engine_id"] == engine_id for i in pools["instances"])

    cluster.wait_until(router_knows_the_reader, timeout_s=60, what=f"the router's view of {decode}'s engine id")
    bound0, any0 = _issued(p_url, "bound"), _issued(p_url, "any")
    prompt = f"Bound to {engine_id[:8]}: " + PROMPT
    headers = {"X-Expected-Context-Tokens": str(TP_POOL_CAPACITY * 2)} if pool == LONG_POOL else {}
    raw = cluster.client().completions.with_raw_response.create(
        model=cluster.model, prompt=prompt, max_tokens=8, temperature=0, extra_headers=headers,
        extra_body={"ignore_eos": True})
    assert raw.headers["x-pdcluster-pool"] == pool and raw.headers["x-pdcluster-prefill"] != "none", raw.headers
    assert _issued(p_url, "bound") == bound0 + 1 and _issued(p_url, "any") == any0
    assert choice_token_ids(raw.parse().choices[0]) == list(cluster.oracle(prompt, 8).token_ids)
    for url in (nodes["tp"], nodes["dcp"], p_url):
        _idle(url, timeout_s=120)
