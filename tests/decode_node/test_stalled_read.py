"""A stalled KV READ stalls only its own request: other streams on the same decode node keep producing tokens.

Real prefill and decode nodes (test backend, real rank processes, real NIXL). The stall is real: with UCX peer
error handling the first READ from a decode node to a prefill agent waits on a TCP handshake that the prefill
rank process must answer, and that process is stopped (SIGSTOP). While the import is pending (its rows are
allocated on the decode node, no answer yet), a whole second stream runs on the decode node from first token to
last. After SIGCONT the import completes (or fails cleanly) and both nodes return to idle rows. Every wait is
on an event (metrics, a thread's answer), with generous deadlines; nothing asserts on elapsed time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.node.nodes import TOY, running_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
PROMPT = "Disaggregated serving splits prefill and decode. " * 30  # 1,470 tokens: 2 attention rows + 2 KDA rows
IMPORT_ROWS = 4
PEER_MODE = {"KV__ERROR_HANDLING": "peer", "KV__TIMEOUT_S": "300", "KV__REPOST_AFTER_S": "5"}


@pytest.fixture(scope="module")
def nodes():
    common = ["--num-rows", "16", "--max-context", "8192"]
    with running_nodes(("prefill", common + ["--tp", "1", "--lease-seconds", "600"],
                        {"PREFILL_BACKEND": TOY, "PREFILL_ENGINE_ID": "p-stall",
                         **{f"PREFILL_{k}": v for k, v in PEER_MODE.items()}}),
                       ("decode", common + ["--tp", "1"],
                        {"DECODE_BACKEND": TOY, **{f"DECODE_{k}": v for k, v in PEER_MODE.items()}})) as (p, d):
        yield p, d


def _metric(url: str, name: str) -> float:
    match = re.search(re.escape(name) + r"(\{[^}]*\})? ([0-9.e+-]+)", httpx.get(f"{url}/metrics", timeout=30).text)
    assert match, name
    return float(match.group(2))


def _wait(predicate, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rank_pids(node_pid: int) -> list[int]:
    """The node's rank processes (multiprocessing spawn children, not its resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == node_pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _export(p_url: str) -> dict:
    resp = httpx.post(f"{p_url}/v1/completions", headers={"X-Request-Id": "stalled"}, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def _stream(d_url: str, max_tokens: int) -> tuple[int, int, str | None]:
    """A colocated stream on the decode node, read to its end: (chunks received, completion tokens the final
    usage chunk counts, finish reason)."""
    chunks, tokens, finish = 0, 0, None
    with httpx.stream("POST", f"{d_url}/v1/completions", timeout=120, json={
            "prompt": "another user", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                chunks += 1
                finish = choice.get("finish_reason") or finish
    return chunks, tokens, finish


def test_stalled_read_does_not_stall_other_streams(nodes):
    prefill, decode = nodes
    p_url, d_url = prefill.url, decode.url
    params = _export(p_url)
    ranks = _rank_pids(prefill.proc.pid)
    assert len(ranks) == 1, ranks
    answer: dict = {}

    def import_and_decode() -> None:
        answer["resp"] = httpx.post(f"{d_url}/v1/completions", headers={"X-Request-Id": "stalled"}, timeout=600,
                                    json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                          "kv_transfer_params": params})

    os.kill(ranks[0], signal.SIGSTOP)
    try:
        importer = threading.Thread(target=import_and_decode, daemon=True)
        importer.start()
        # the import is posted: its rows are allocated on the decode node, and it has no answer yet
        _wait(lambda: _metric(d_url, "pdcluster_node_kv_rows_used") == IMPORT_ROWS, "the import's rows")
        chunks, tokens, finish = _stream(d_url, max_tokens=64)
        assert chunks > 1 and (tokens, finish) == (64, "length")  # a whole stream ran while the READ was stalled
        assert importer.is_alive() and "resp" not in answer, "the import was not pending during the stream"
        assert _metric(d_url, "pdcluster_node_kv_rows_used") == IMPORT_ROWS
    finally:
        os.kill(ranks[0], signal.SIGCONT)
    importer.join(600)
    assert not importer.is_alive(), "the import never answered after SIGCONT"
    resp = answer["resp"]
    if resp.status_code == 200:  # the reposted READ completed: the request decoded from the imported rows
        assert resp.json()["usage"]["completion_tokens"] == 12
    else:  # or it failed cleanly, as an OpenAI error
        assert resp.status_code == 502 and "KV transfer" in resp.json()["error"]["message"], resp.text
    for url in (d_url, p_url):
        _wait(lambda url=url: _metric(url, "pdcluster_node_kv_rows_used") == 0
              and _metric(url, "vllm:num_requests_running") == 0, f"{url} idle")
