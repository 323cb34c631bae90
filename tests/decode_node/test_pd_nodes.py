"""Prefill node -> decode node over real HTTP (uvicorn processes), real rank processes and real NIXL.

The ranks run the node test backend (tests/node/toy_backend.py), whose output tokens are a CRC of the
request's rows: the decode node reproduces the colocated tokens only if every transferred byte is intact.
Covers the vLLM wire protocol both ways, streaming and not, pools back to idle after notification,
abort and client disconnect, clean 4xx for bad params and the KV-load failure policies.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.node.nodes import TOY, control_auth, running_nodes, signed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
PROMPT = "Disaggregated serving splits prefill and decode. " * 30  # 1,470 tokens: 2 P rows of 1,024


@pytest.fixture(scope="module")
def nodes():
    common = ["--num-rows", "16", "--max-context", "8192"]
    with running_nodes(("prefill", common + ["--tp", "1", "--lease-seconds", "60"],
                        {"PREFILL_BACKEND": TOY, "PREFILL_ENGINE_ID": "p-e2e"}),
                       ("decode", common + ["--tp", "1", "--kv-load-failure-policy", "fail"],
                        {"DECODE_BACKEND": TOY})) as (prefill, decode):
        yield prefill.url, decode.url, decode.proc


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(re.escape(name) + (r"\{[^}]*" + labels + r"[^}]*\}" if labels else r"(\{[^}]*\})?")
                      + r" ([0-9.e+-]+)", text)
    assert match, name
    return float(match.groups()[-1])


def _idle(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _metric(url, "pdcluster_node_kv_rows_used") == 0 and _metric(url, "vllm:num_requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not return to idle: {_metric(url, 'pdcluster_node_kv_rows_used')} rows used")


def _prefill(p_url: str, request_id: str, prompt: str = PROMPT) -> dict:
    resp = httpx.post(f"{p_url}/v1/completions", headers={"X-Request-Id": request_id}, timeout=60, json={
        "model": "kimi-k3.1-mini", "prompt": prompt, "max_tokens": 1, "stream": False, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _decode_body(params: dict, max_tokens: int = 12, **extra) -> dict:
    return {"model": "kimi-k3.1-mini", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "kv_transfer_params": params, **extra}


def test_remote_decode_equals_colocated(nodes):
    p_url, d_url, _ = nodes
    oracle = httpx.post(f"{p_url}/v1/completions", timeout=60,
                        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    params = _prefill(p_url, "pd-1")
    assert params["remote_num_tokens"] == len(PROMPT) and len(params["remote_block_ids"][0]) == 2
    resp = httpx.post(f"{d_url}/v1/completions", headers={"X-Request-Id": "pd-1"}, timeout=60,
                      json=_decode_body(params))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["token_ids"] == oracle["choices"][0]["token_ids"]
    assert body["choices"][0]["text"] == oracle["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(PROMPT) and body["usage"]["completion_tokens"] == 12
    _idle(d_url)
    _idle(p_url)
    assert _metric(p_url, "pdcluster_node_lease_outcomes_total", 'outcome="notified"') >= 1
    assert _metric(d_url, "vllm:nixl_bytes_transferred_sum") > 0


def test_remote_decode_streaming_chat_equals_colocated(nodes):
    p_url, d_url, _ = nodes
    messages = [{"role": "user", "content": PROMPT}]
    oracle = httpx.post(f"{p_url}/v1/chat/completions", timeout=60,
                        json={"messages": messages, "max_tokens": 10, "temperature": 0}).json()
    resp = httpx.post(f"{p_url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = resp.json()["kv_transfer_params"]
    with httpx.stream("POST", f"{d_url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params}) as stream:
        data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == oracle["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    _idle(d_url)
    _idle(p_url)


@pytest.mark.parametrize("tamper,needle", [
    ({"remote_engine_id": "somebody-else"}, "unknown remote_engine_id"),
    ({"lease_expiry": 1.0}, "expired"),
    ({"layout_fingerprint": "0123456789abcdef"}, "fingerprint"),
    ({"tp_size": 3}, "power of two"),
    ({"remote_block_ids": [[0, 999]]}, "out of range"),
    ({"remote_block_ids": "rows"}, "malformed"),
    ({"remote_num_tokens": 5}, "remote_num_tokens"),
], ids=["unknown-engine", "expired-lease", "fingerprint", "geometry", "rows-out-of-range", "malformed",
        "token-count"])
def test_bad_params_are_clean_4xx(nodes, tamper, needle):
    p_url, d_url, _ = nodes
    request_id = f"bad-{next(iter(tamper))}"
    params = _prefill(p_url, request_id)
    altered = {**params, **tamper}
    if isinstance(altered["remote_block_ids"], list):  # signed again: the checks past the signature are under test
        altered = signed(altered)
    resp = httpx.post(f"{d_url}/v1/completions", timeout=60, json=_decode_body(altered))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["param"] == "kv_transfer_params"
    _idle(d_url)
    httpx.post(f"{p_url}/abort_requests", json={"request_ids": [request_id]}, auth=control_auth())
    _idle(p_url)


def test_client_disconnect_and_abort_free_rows(nodes):
    p_url, d_url, _ = nodes
    params = _prefill(p_url, "pd-disconnect")
    with httpx.stream("POST", f"{d_url}/v1/completions", timeout=60,
                      json=_decode_body(params, max_tokens=6000, stream=True)) as stream:
        for i, _line in enumerate(stream.iter_lines()):
            if i >= 6:
                break
    _idle(d_url)
    _idle(p_url)
    params = _prefill(p_url, "pd-abort")
    with httpx.stream("POST", f"{d_url}/v1/completions", headers={"X-Request-Id": "pd-abort"}, timeout=60,
                      json=_decode_body(params, max_tokens=6000, stream=True)) as stream:
        lines = stream.iter_lines()
        next(lines)
        assert httpx.post(f"{d_url}/abort_requests", json={"request_ids": ["pd-abort"]},
                          auth=control_auth()).json()["aborted"] == ["pd-abort"]
        data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    _idle(d_url)


def test_unreachable_prefill_fails_cleanly(nodes):
    p_url, d_url, _ = nodes
    params = _prefill(p_url, "pd-gone")
    resp = httpx.post(f"{d_url}/v1/completions", timeout=60,
                      json=_decode_body(signed({**params, "remote_port": free_port()})))
    assert resp.status_code == 502 and "side channel" in resp.json()["error"]["message"]
    _idle(d_url)
    httpx.post(f"{p_url}/abort_requests", json={"request_ids": ["pd-gone"]}, auth=control_auth())
    _idle(p_url)


def test_killed_rank_fails_health_and_requests(nodes):
    import os
    import signal

    p_url, d_url, d_proc = nodes
    pids = [int(pid) for pid in os.popen(f"pgrep -P {d_proc.pid}").read().split()]
    rank_pids = [pid for pid in pids if "pdcluster-rank" in open(f"/proc/{pid}/cmdline").read()
                 or "multiprocessing" in open(f"/proc/{pid}/cmdline").read()]
    assert rank_pids, "no rank process under the decode node"
    os.kill(rank_pids[-1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{d_url}/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{d_url}/health").status_code == 503
    resp = httpx.post(f"{d_url}/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 503 and "engine is down" in resp.json()["error"]["message"]
