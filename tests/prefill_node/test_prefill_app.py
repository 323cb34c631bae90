"""Prefill node over in-process HTTP (real rank process, test backend): request parsing, OpenAI error
shapes, the do_remote_decode answer, leases ended by abort / expiry, metrics names."""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient

from prefill_node.app import create_app
from prefill_node.settings import Settings
from tests.node.nodes import TEST_CLUSTER_SECRET, TOY, control_auth

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


HELD_LEASE_S = 600.0
"""The module's node: no lease ends by expiry while a test looks at it (a 1.5 s lease ran out between an export and
its abort when the machine was loaded)."""
EXPIRING_LEASE_S = 3.0
"""The expiry test's node: a lease it watches run out."""


def _client(lease_seconds: float):
    settings = Settings(backend=TOY, num_rows=16, max_context=4096, lease_seconds=lease_seconds, lease_sweep_s=0.1,
                        engine_id="prefill-test", port=8123, cluster_secret=TEST_CLUSTER_SECRET)
    return TestClient(create_app(settings))


@pytest.fixture(scope="module")
def client():
    with _client(HELD_LEASE_S) as c:
        yield c


@pytest.fixture
def expiring_client():
    with _client(EXPIRING_LEASE_S) as c:
        yield c


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + labels + r"[^}]*\}" if labels else r"(\{[^}]*\})?") + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    assert match, f"{name} {labels} not in metrics"
    return float(match.groups()[-1])


def _rows_used(client: TestClient) -> float:
    return _metric(client.get("/metrics").text, "pdcluster_node_kv_rows_used")


def _wait_rows(client: TestClient, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _rows_used(client) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rows_used(client) == value


def _error(resp, status: int, param: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == status and body["type"]
    if param is not None:
        assert body["param"] == param, body
    return body["message"]


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "x" * 5000}, "prompt", "maximum context length is 4096"),
    ({"prompt": "hi", "max_tokens": 4095}, "max_tokens", "4097 tokens"),
    ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "n": 2}, "n", "n=1"),
    ({"prompt": "hi", "kv_transfer_params": "yes"}, "kv_transfer_params", None),
    ({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": "maybe"}}, "kv_transfer_params", "malformed"),
    ({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 4}, "max_tokens",
     "max_tokens=1"),
    ({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1, "stream": True},
     "stream", "cannot stream"),
], ids=["empty-text", "empty-ids", "over-context", "output-over-context", "bad-token", "n2", "params-not-object",
        "params-malformed", "remote-decode-max-tokens", "remote-decode-stream"])
def test_bad_input_is_openai_400(client, body, param, needle):
    message = _error(client.post("/v1/completions", json=body), 400, param)
    if needle:
        assert needle in message


def test_chat_errors_and_unknown_fields(client):
    _error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    _error(client.post("/v1/completions", content=b"{not json"), 400)
    _error(client.post("/v1/completions", json={"prompt": "hi", "model": "other"}), 404, "model")
    # a field this server does not know is refused by name (a parameter is honoured or refused, never ignored)
    message = _error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0,
                                                          "some_future_field": {"x": 1}}), 400, "some_future_field")
    assert "not supported" in message
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0, "user": "u"})
    assert ok.status_code == 200, ok.text


def test_models_health_metrics(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "kimi-k3.1-mini" and models["data"][0]["max_model_len"] == 4096
    # one served request of its own, so the labelled histograms have a child whatever ran before
    served = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200, served.text
    text = client.get("/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "pdcluster_node_leases_outstanding", "pdcluster_node_kv_rows_total"):
        assert name in text
    info = re.search(r"vllm:cache_config_info\{([^}]*)\} 1.0", text).group(1)
    for label in ('block_size="1024"', 'num_gpu_blocks="16"', 'tp_size="1"', 'dcp_size="1"', 'engine="reference"',
                  "layout_fingerprint=", "cache_dtype="):
        assert label in info
    assert 'le="2.0"' in text


def test_tokenize(client):
    body = client.post("/tokenize", json={"prompt": "abc"}).json()
    assert body["tokens"] == [97, 98, 99] and body["count"] == 3 and body["max_model_len"] == 4096
    _error(client.post("/tokenize", json={}), 400)


def test_colocated_completion_and_chat(client):
    resp = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
    body = resp.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_completion_tokens": 3}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    assert chat["choices"][0]["message"]["role"] == "assistant"


def test_streaming_with_usage(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _export(client: TestClient, request_id: str, prompt: str = "disaggregate me") -> dict:
    resp = client.post("/v1/completions", headers={"X-Request-Id": request_id}, json={
        "prompt": prompt, "max_tokens": 1, "stream": False, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_remote_decode_answer_matches_vllm_shape_and_colocated_first_token(client):
    body = _export(client, "req-shape")
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-test" and params["remote_request_id"] == "req-shape"
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == 8123
    assert params["tp_size"] == 1 and params["dcp_size"] == 1 and params["remote_num_tokens"] == 15
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 1
    assert len(params["remote_kda_block_ids"]) == 2 and params["block_size"] == 1024
    assert params["lease_id"] and params["lease_expiry"] > time.time()
    assert params["remote_blocks_expiry_time"] == params["lease_expiry"]
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    colocated = client.post("/v1/completions", json={"prompt": "disaggregate me", "max_tokens": 1}).json()
    assert body["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"] == [params["first_token_id"]]
    unsigned = client.post("/abort_requests", json={"request_ids": ["req-shape"]})
    _error(unsigned, 401)
    assert _rows_used(client) == 3  # an anonymous caller on the pod network aborts nothing
    assert client.post("/abort_requests", json={"request_ids": ["req-shape"]}, auth=control_auth()).json() == {
        "aborted": ["req-shape"]}
    _wait_rows(client, 0)


def test_a_node_that_requires_a_reader_refuses_unbound_export_requests():
    """With `require_reader` (the chart's setting) an export request naming no decode engine is a 400 before any
    row is computed, and one naming it is leased to that reader alone. Its own node: the shared one keeps vLLM's
    default (unbound requests accepted)."""
    settings = Settings(backend=TOY, num_rows=16, max_context=4096, engine_id="prefill-bound", port=8124,
                        cluster_secret=TEST_CLUSTER_SECRET, require_reader=True)
    with TestClient(create_app(settings)) as bound:
        wire = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
        request = {"prompt": "disaggregate me", "max_tokens": 1, "stream": False}
        message = _error(bound.post("/v1/completions", json={**request, "kv_transfer_params": wire}), 400,
                         "kv_transfer_params")
        assert "decode_engine_id is required" in message and _rows_used(bound) == 0
        answer = bound.post("/v1/completions", json={**request, "kv_transfer_params": {**wire,
                                                                                      "decode_engine_id": "decode-a"}})
        assert answer.status_code == 200, answer.text
        lease_id = answer.json()["kv_transfer_params"]["lease_id"]
        assert answer.json()["kv_transfer_params"]["decode_engine_id"] == "decode-a"
        _error(bound.post(f"/kv/leases/{lease_id}/claim", json={"reader": "decode-b"}, auth=control_auth()), 403)
        assert bound.post(f"/kv/leases/{lease_id}/claim", json={"reader": "decode-a"},
                          auth=control_auth()).status_code == 200


@pytest.mark.parametrize("method,path", [("GET", "/kv/metadata"), ("POST", "/kv/leases/" + "0" * 32 + "/abort"),
                                         ("POST", "/kv/leases/" + "0" * 32 + "/bind"),
                                         ("POST", "/abort_requests"), ("GET", "/v1/cache")])
def test_control_routes_refuse_unsigned_callers(client, method, path):
    """The control routes answer 401 to a caller without the cluster secret, or signing with another one."""
    body = {"request_ids": ["x"]} if path == "/abort_requests" else {"reader": "decode-x"} if "leases" in path else None
    for auth in (None, control_auth("another-cluster-secret-0123456789")):
        message = _error(client.request(method, path, json=body, auth=auth), 401)
        assert "cluster" in message and TEST_CLUSTER_SECRET not in message
    assert client.request(method, path, json=body, auth=control_auth()).status_code in (200, 404, 503)


def test_lease_expiry_frees_rows_and_side_channel(expiring_client):
    client = expiring_client
    meta = client.get("/kv/metadata", auth=control_auth()).json()
    assert meta["engine_id"] == "prefill-test" and meta["ranks"][0]["agent_name"] == "prefill-test-p0"
    params = _export(client, "req-expire")["kv_transfer_params"]
    assert _rows_used(client) == 3
    _wait_rows(client, 0, timeout_s=60)
    text = client.get("/metrics").text
    assert _metric(text, "pdcluster_node_lease_outcomes_total", 'outcome="expired"') >= 1
    assert _metric(text, "vllm:nixl_num_kv_expired_reqs_total") >= 1
    assert _metric(text, "pdcluster_node_leases_outstanding") == 0
    _error(client.post(f"/kv/leases/{params['lease_id']}/abort", json={"reader": "decode-x"}, auth=control_auth()),
           404, "lease_id")
