"""Graceful shutdown of a real node process (`pdcluster decode`, reference engine, uvicorn): SIGTERM during a
400-token stream lets that stream finish completely, while a new request gets 503 with Retry-After and /health
turns 503 (readiness fails); once the stream ended the node exits 0 on its own.
The separate metrics port serves /metrics (and nothing else) meanwhile."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from serving.errors import DRAINING_HEADER
from tests.conftest import free_port
from tests.node.nodes import running_nodes

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]
NUM_TOKENS = 400


def test_sigterm_drains_a_400_token_stream_and_sheds_new_requests():
    metrics_port = free_port()
    # a drain bound far beyond the stream's time on a loaded machine: the stream ends the drain, not the bound
    args = ["--model", "kimi-k3.1-mini", "--tp", "1", "--num-rows", "16", "--metrics-port", str(metrics_port),
            "--drain-s", "900"]
    with running_nodes(("decode", args, None)) as (node,):
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        assert "pdcluster_node_requests_total" in httpx.get(f"{metrics_url}/metrics", timeout=30).text
        assert httpx.post(f"{metrics_url}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 404
        body = {"model": "kimi-k3.1-mini", "prompt": "Graceful shutdown keeps streams.", "max_tokens": NUM_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=600) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            node.proc.send_signal(signal.SIGTERM)
            shed = httpx.post(f"{node.url}/v1/completions", timeout=60,
                              json={"model": "kimi-k3.1-mini", "prompt": "too late", "max_tokens": 4})
            health = httpx.get(f"{node.url}/health", timeout=60)
            data = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
        assert shed.status_code == 503 and shed.headers.get("retry-after"), shed.text
        assert shed.headers.get(DRAINING_HEADER) == "1"  # a router re-places it (router/admission.py)
        assert shed.json()["error"]["code"] == 503
        assert health.status_code == 503 and health.headers.get("retry-after")
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "length"
        assert node.proc.wait(timeout=120) == 0  # the drain ended with the stream: a clean exit


def test_sigterm_with_hand_off_ends_the_stream_with_a_503_event_and_exits_0():
    """`--drain-hand-off-s 0`: the running stream ends at once with a 503 error event naming the drain (what our
    router moves to another instance, router/migration.py) and the node exits 0 without waiting for it."""
    args = ["--model", "kimi-k3.1-mini", "--tp", "1", "--num-rows", "16", "--drain-s", "900",
            "--drain-hand-off-s", "0"]
    with running_nodes(("decode", args, None)) as (node,):
        body = {"model": "kimi-k3.1-mini", "prompt": "Hand the stream off.", "max_tokens": NUM_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=600) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            node.proc.send_signal(signal.SIGTERM)
            data = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == 503 and "draining" in error["message"]
        tokens = sum(1 for d in data[:-2] if json.loads(d).get("choices"))
        assert tokens < NUM_TOKENS
        assert node.proc.wait(timeout=120) == 0
