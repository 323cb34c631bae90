"""Log-probs and sampling parameters over HTTP on a real decode node (reference engine, TP=1, colocated: the shared
cluster's `tp` node).

The served log-prob of every generated token is the engine's own, bit for bit (JSON floats round-trip
exactly), in both OpenAI formats, streaming and not; top alternatives are sorted, ties to the lower id, and
hold the sampled token whenever the request is greedy.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.engine import Engine, EngineConfig
from engine.model.tokenizer import ByteTokenizer
from engine.sampling import SamplingParams
from node.logprobs import token_name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
PROMPT = "Log-probs travel with every token."


@pytest.fixture(scope="module")
def node(cluster):
    """The shared cluster's `tp` decode node (tests/topologies.py), addressed directly: colocated requests."""
    return cluster.nodes_of(pool="tp")[0].url


@pytest.fixture(scope="module")
def oracle():
    """Greedy and seeded-sampled answers with log-probs, from the engine in this process."""
    engine = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=16))
    ids = ByteTokenizer().encode(PROMPT)
    greedy = engine.generate("g", ids, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
    sampled = engine.generate("s", ids, SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=3))
    return {"greedy": greedy, "sampled": sampled}


def _stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("mode,extra", [("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 7})])
def test_completion_logprobs_are_the_engines(node, oracle, mode, extra):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3, "ignore_eos": True, **extra}
    out = httpx.post(f"{node}/v1/completions", json=body, timeout=300).json()
    logprobs = out["choices"][0]["logprobs"]
    want = oracle[mode]
    assert out["choices"][0]["token_ids"] == want.token_ids
    assert logprobs["token_logprobs"] == want.logprobs
    tok = ByteTokenizer()
    assert logprobs["tokens"] == [token_name(tok, t) for t in want.token_ids]
    for position, top in enumerate(logprobs["top_logprobs"]):
        values = list(top.values())
        assert len(top) in (3, 4) and logprobs["tokens"][position] in top
        assert sorted(values[:3], reverse=True) == values[:3]
        if mode == "greedy":
            assert top[logprobs["tokens"][position]] == max(values)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    streamed = _stream(node, "/v1/completions", body)
    tokens, values = [], []
    for chunk in streamed:
        for choice in chunk["choices"]:
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
    assert (tokens, values) == (logprobs["tokens"], logprobs["token_logprobs"])


def test_chat_logprobs_content_format(node):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    out = httpx.post(f"{node}/v1/chat/completions", json=body, timeout=300).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry["logprob"], float) and entry["bytes"]
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the sampled token is the most likely
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    streamed = [e for chunk in _stream(node, "/v1/chat/completions", body) for c in chunk["choices"]
                if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == content


def test_logprobs_not_asked_stay_null_and_bad_values_are_refused(node):
    out = httpx.post(f"{node}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=300).json()
    assert out["choices"][0]["logprobs"] is None
    bad = httpx.post(f"{node}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 21}, timeout=60)
    assert bad.status_code == 400 and "logprobs" in bad.text
    orphan = httpx.post(f"{node}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_logprobs": 2})
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "top_logprobs"


def test_echo_scores_the_prompt_and_matches_served_logprobs(node, oracle):
    """Teacher forcing over HTTP: prompt + the served answer, echoed with max_tokens=0, gives back the served
    log-probs bit for bit; the first prompt token has none; vLLM's prompt_logprobs agree."""
    want = oracle["sampled"]
    ids = ByteTokenizer().encode(PROMPT)
    body = {"prompt": ids + want.token_ids, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 1}
    out = httpx.post(f"{node}/v1/completions", json=body, timeout=300).json()
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["token_ids"] == ids + want.token_ids and out["usage"]["completion_tokens"] == 0
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][len(ids):] == want.logprobs
    vllm_style = choice["prompt_logprobs"]
    assert vllm_style[0] is None
    for position, token in enumerate(want.token_ids, start=len(ids)):
        assert vllm_style[position][str(token)]["logprob"] == want.logprobs[position - len(ids)]
        assert vllm_style[position][str(token)]["rank"] >= 1
    streamed = _stream(node, "/v1/completions", body)
    first = streamed[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]
    assert first["prompt_logprobs"] == vllm_style


def test_echo_prefixes_the_prompt_text(node):
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{node}/v1/completions", json={**body, "echo": False}, timeout=300).json()
    echoed = httpx.post(f"{node}/v1/completions", json=body, timeout=300).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    streamed = "".join(c["text"] for chunk in _stream(node, "/v1/completions", body) for c in chunk["choices"])
    assert streamed == echoed["choices"][0]["text"]
    zero = httpx.post(f"{node}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens"


def test_stop_strings_and_stop_token_ids_end_the_answer(node):
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{node}/v1/completions", json=base, timeout=300).json()["choices"][0]
    ids = full["token_ids"]
    stop_id = ids[3]
    by_id = httpx.post(f"{node}/v1/completions", json={**base, "stop_token_ids": [stop_id]}, timeout=300).json()
    choice = by_id["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == ids[: ids.index(stop_id) + 1]
    sampled = {**base, "temperature": 1.0, "seed": 0}  # the model answers noise: a seed whose text has characters
    text = httpx.post(f"{node}/v1/completions", json=sampled, timeout=300).json()["choices"][0]["text"]
    stop = next((c for c in reversed(text) if c != "\ufffd"), None)
    if stop is None:
        pytest.fail(f"the sampled answer {text!r} has no character to use as a stop string")
    by_text = httpx.post(f"{node}/v1/completions", json={**sampled, "stop": [stop]}, timeout=300).json()["choices"][0]
    assert by_text["finish_reason"] == "stop" and by_text["text"] == text[: text.index(stop)]


def test_top_k_min_p_and_seed_are_honoured(node):
    base = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    greedy = httpx.post(f"{node}/v1/completions", json={**base, "temperature": 0}, timeout=300).json()
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        hot = httpx.post(f"{node}/v1/completions", json={**base, "temperature": 1.5, "seed": 3, **extra},
                         timeout=300).json()
        assert hot["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], extra
    seeded = [httpx.post(f"{node}/v1/completions", json={**base, "temperature": 1.0, "seed": 42}, timeout=300).json()
              for _ in range(2)]
    assert seeded[0]["choices"][0]["token_ids"] == seeded[1]["choices"][0]["token_ids"]
    bad = httpx.post(f"{node}/v1/completions", json={**base, "min_p": 2}, timeout=60)
    assert bad.status_code == 400 and "min_p" in bad.text


def test_penalties_are_honoured_and_range_checked(node):
    """presence/frequency/repetition penalties: the node serves the engine's tokens, which the penalties change
    (this greedy answer repeats a token); out of range is a 400 naming the parameter."""
    base = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{node}/v1/completions", json=base, timeout=300).json()["choices"][0]["token_ids"]
    engine = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=16))
    ids = ByteTokenizer().encode(PROMPT)
    for name, value in (("presence_penalty", 1.0), ("frequency_penalty", 1.0), ("repetition_penalty", 1.3)):
        got = httpx.post(f"{node}/v1/completions", json={**base, name: value}, timeout=300).json()
        want = engine.generate(name, ids, SamplingParams(max_tokens=24, ignore_eos=True, **{name: value}))
        assert got["choices"][0]["token_ids"] == want.token_ids != plain, name
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        bad = httpx.post(f"{node}/v1/completions", json={**base, name: value}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name, bad.text
