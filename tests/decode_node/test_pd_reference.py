"""End to end with the reference engine: real node processes, real rank processes (gloo), real NIXL.

The nodes are the shared cluster's (tests/topologies.py), addressed directly without the router, plus a TP=2
decode node. A prefill node at TP=2 (`pdcluster prefill --tp 2`, token-sharded prefill) answers do_remote_decode requests;
decode nodes at TP=1, TP=2 and DCP=2 read the rows (remapped across TP sizes and block sizes; a DCP rank reads
only the tokens it owns), decode, and must produce exactly the greedy tokens of `pdcluster generate` (the
single-rank oracle, tests/oracle.py), streaming and not. The DCP=2 node's merge counters show the compact top-k merge ran.
Afterwards every pool is back to idle (leases notified, decode rows freed).
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.model.tokenizer import ByteTokenizer
from tests.decode_node.test_pd_nodes import _idle, _metric
from tests.oracle import generate_text
from tests.topologies import LONG_POOL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
PROMPT = ("Disaggregated serving splits prefill and decode across machines. " * 16)[:1019]
"""1020 tokens with BOS: prompt + MAX_TOKENS crosses the 1024-token decode block, so D holds one row more
than the transferred tokens fill (the spare row is for generated tokens)."""
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def nodes(cluster, decode_tp2):
    """The shared cluster's prefill (TP=2), `tp` (TP=1) and `dcp` (DCP=2) nodes, addressed directly, and a TP=2
    decode node peered with that prefill node (tests/topologies.py)."""
    return {"prefill": cluster.nodes_of(role="prefill")[0].url, "tp1": cluster.nodes_of(pool="tp")[0].url,
            "tp2": decode_tp2, "dcp2": cluster.nodes_of(pool=LONG_POOL)[0].url}


@pytest.fixture(scope="module")
def oracle():
    return generate_text(PROMPT, MAX_TOKENS)["token_ids"]


def _prefill(p_url: str) -> dict:
    resp = httpx.post(f"{p_url}/v1/completions", timeout=600, json={
        "prompt": PROMPT, "max_tokens": 1, "stream": False, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


@pytest.mark.parametrize("pool", ["tp1", "tp2", "dcp2"])
def test_prefill_tp2_to_decode_equals_generate(nodes, oracle, pool):
    p_url, d_url = nodes["prefill"], nodes[pool]
    params = _prefill(p_url)
    assert params["tp_size"] == 2 and params["first_token_id"] == oracle[0]
    resp = httpx.post(f"{d_url}/v1/completions", timeout=600, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == oracle

    params = _prefill(p_url)
    with httpx.stream("POST", f"{d_url}/v1/completions", timeout=600, json={
            "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params}) as stream:
        data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert data[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == len(oracle)
    assert text == ByteTokenizer().decode(oracle)
    _idle(d_url, timeout_s=120)
    _idle(p_url, timeout_s=120)
    assert _metric(p_url, "pdcluster_node_lease_outcomes_total", 'outcome="notified"') >= 2
    assert _metric(p_url, "pdcluster_node_alltoall_bytes_total") > 0
    assert _metric(p_url, "pdcluster_node_prefill_seconds_count", 'mode="token_sharded"') >= 2
    if pool == "dcp2":
        assert _metric(d_url, "pdcluster_node_dcp_merge_bytes_total", 'method="compact"') > 0
    # transfer telemetry of both imports (at least one posted READ each)
    assert _metric(d_url, "vllm:nixl_post_time_seconds_count") >= 2
    assert _metric(d_url, "vllm:nixl_num_descriptors_count") >= 2 and _metric(d_url, "vllm:nixl_num_descriptors_sum") >= 2


@pytest.mark.parametrize("pool", ["tp1", "tp2", "dcp2"])
def test_colocated_equals_generate(nodes, oracle, pool):
    resp = httpx.post(f"{nodes[pool]}/v1/completions", timeout=600,
                      json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == oracle
    _idle(nodes[pool], timeout_s=120)
    assert _metric(nodes[pool], "pdcluster_node_prefill_seconds_count") >= 1  # the local prefill step, timed


def test_client_leaving_a_dcp_stream_frees_rows_on_both_nodes(nodes):
    """A client that leaves mid-stream: the DCP node aborts the request and frees its rows on both ranks; the
    prefill node's rows were already freed by the read's notification. Both pools return to idle."""
    p_url, d_url = nodes["prefill"], nodes["dcp2"]
    params = _prefill(p_url)
    chunks = 0
    with httpx.stream("POST", f"{d_url}/v1/completions", timeout=600, json={
            "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True,
            "kv_transfer_params": params}) as stream:
        for line in stream.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 2:
                break
    assert chunks == 2
    _idle(d_url, timeout_s=120)
    _idle(p_url, timeout_s=120)
    assert _metric(d_url, "vllm:request_success_total", 'finished_reason="abort"') >= 1


def _score_on(url: str, token_ids: list[int]) -> list[float | None]:
    """Teacher forcing: the prompt log-probs of `token_ids` (echo, max_tokens 0) from the node at `url`."""
    resp = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "prompt": token_ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1234}], ids=["greedy", "seeded"])
def test_served_logprobs_equal_teacher_forcing_on_every_pairing(nodes, sampling):
    """Zero mismatch: on P TP=2 -> D TP=1 / TP=2 / DCP=2 and colocated on each D, every served log-prob (the first
    one computed by the prefill leg) equals, bit for bit, the log-prob of that token when prompt + answer is scored
    again through the prefill node's token-sharded prefill; every pairing serves the same tokens."""
    prompt_ids = ByteTokenizer().encode(PROMPT)
    body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "logprobs": 1, "ignore_eos": True, **sampling}
    served = {}
    for pool in ("tp1", "tp2", "dcp2"):
        params = httpx.post(f"{nodes['prefill']}/v1/completions", timeout=600, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        assert isinstance(params["first_token_logprob"], float)
        for mode, extra in (("pd", {"kv_transfer_params": params}), ("colocated", {})):
            resp = httpx.post(f"{nodes[pool]}/v1/completions", timeout=600, json={**body, **extra})
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            served[(pool, mode)] = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
    answers = {tokens for tokens, _ in ((tuple(t), lp) for t, lp in served.values())}
    assert len(answers) == 1, f"pairings served different tokens: {answers}"
    answer = list(answers.pop())
    scored = _score_on(nodes["prefill"], prompt_ids + answer)[len(prompt_ids):]
    for key, (_, logprobs) in served.items():
        assert logprobs == scored, f"{key}: served log-probs differ from teacher forcing"
    for url in nodes.values():
        _idle(url, timeout_s=120)
