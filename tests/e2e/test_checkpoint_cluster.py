"""A checkpoint served through the whole PD path (`pdcluster up --model DIR`: P TP=2 -> D `tp` TP=1 / `dcp` DCP=2),
with the official `openai` client, against transformers, the implementation nobody here wrote: the checkpoint is
tests/checkpoints.py's `kimi-mix` (KDA and MLA layers interleaved, MoE) with a BPE tokenizer trained in the test
(tests/checkpoint_tokenizer.py) and a chat template beside it.

- greedy 32-token continuations (completions and chat, P -> D on both decode pools) are transformers' `generate`
  token for token, and the prompt ids are `AutoTokenizer`'s (`encode`, `apply_chat_template`);
- streamed text adds up to the whole answer and never carries half a character; log-prob token names are the
  tokens' own bytes; `/tokenize` on a node gives the template's ids;
- a request without `model` is served by the cluster's one model (the README's first curl).
The served log-probs' equality with `echo` scoring on this checkpoint is tests/e2e/test_logprobs_cluster.py's.
"""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.e2e.harness import choice_token_ids
from tests.topologies import LONG_POOL, TP_POOL_CAPACITY, checkpoint_model_dir

pytestmark = pytest.mark.e2e

POOLS = ("tp", LONG_POOL)
NUM_TOKENS = 32
PROMPT = "The agent reads the file, patches the diff and runs the tests. Caf\u00e9 \u4f60\u597d"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, how are you today? \U0001f600"}]
GREEDY = {"temperature": 0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}


def _headers(pool: str) -> dict[str, str]:
    return {"X-Expected-Context-Tokens": str(TP_POOL_CAPACITY * 2)} if pool == LONG_POOL else {}


@functools.cache
def _oracle():
    """(transformers model, AutoTokenizer) of the served checkpoint; generation runs to its length (no EOS stop, as
    the requests send ignore_eos)."""
    from transformers import AutoTokenizer

    from tests.checkpoints import hf_model

    directory = checkpoint_model_dir()
    model = hf_model(directory)
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(str(directory))


def _hf_greedy(prompt_ids: list[int]) -> list[int]:
    import torch

    model, _ = _oracle()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NUM_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("pool", POOLS)
def test_greedy_completion_equals_transformers_generate(checkpoint_cluster, pool):
    _, tokenizer = _oracle()
    raw = checkpoint_cluster.client().completions.with_raw_response.create(
        model=checkpoint_cluster.model, prompt=PROMPT, extra_headers=_headers(pool), **GREEDY)
    result = raw.parse()
    assert raw.headers["x-pdcluster-pool"] == pool and raw.headers["x-pdcluster-prefill"] != "none"
    prompt_ids = tokenizer.encode(PROMPT)
    assert result.usage.prompt_tokens == len(prompt_ids)
    expected = _hf_greedy(prompt_ids)
    assert choice_token_ids(result.choices[0]) == expected
    assert result.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("pool", POOLS)
def test_chat_renders_the_template_and_equals_transformers(checkpoint_cluster, pool):
    _, tokenizer = _oracle()
    client = checkpoint_cluster.client()
    raw = client.chat.completions.with_raw_response.create(model=checkpoint_cluster.model, messages=MESSAGES,
                                                            extra_headers=_headers(pool), **GREEDY)
    result = raw.parse()
    assert raw.headers["x-pdcluster-prefill"] != "none"
    prompt_ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == NUM_TOKENS
    expected = _hf_greedy(prompt_ids)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert result.choices[0].message.content == text
    stream = client.chat.completions.create(model=checkpoint_cluster.model, messages=MESSAGES, stream=True,
                                            extra_headers=_headers(pool), **GREEDY)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text  # no half character mid-stream


def test_logprob_names_are_the_tokens_bytes_and_tokenize_uses_the_template(checkpoint_cluster):
    _, tokenizer = _oracle()
    client = checkpoint_cluster.client()
    result = client.completions.create(model=checkpoint_cluster.model, prompt=PROMPT, logprobs=2, **GREEDY)
    ids = choice_token_ids(result.choices[0])
    names = result.choices[0].logprobs.tokens
    assert len(names) == len(ids) == NUM_TOKENS
    for token_id, name in zip(ids, names):
        raw = _token_bytes(tokenizer, token_id)
        assert name == (raw.decode() if _is_text(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    chat = client.chat.completions.create(model=checkpoint_cluster.model, messages=MESSAGES, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    expected = _hf_greedy(list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]))
    assert [bytes(e.bytes) for e in chat.choices[0].logprobs.content] == [_token_bytes(tokenizer, i) for i in expected]
    node = checkpoint_cluster.nodes_of(role="decode")[0]
    body = httpx.post(f"{node.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert body["tokens"] == list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's bytes from transformers' side: an added token's text, else its byte-level piece mapped back through
    transformers' own byte alphabet. The model's vocabulary is larger than the tokenizer's: an id the tokenizer
    lacks (random weights emit them) is named `<|id|>`, as the byte tokenizer names unused ids."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return f"<|{token_id}|>".encode()
    if token_id in tokenizer.added_tokens_decoder:
        return piece.encode()
    alphabet = {ch: b for b, ch in bytes_to_unicode().items()}
    return bytes(alphabet[ch] for ch in piece)


def _is_text(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_requests_without_model_are_served(checkpoint_cluster):
    models = checkpoint_cluster.client().models.list()
    assert [m.id for m in models.data] == [checkpoint_cluster.model] == [str(checkpoint_model_dir())]
    answer = httpx.post(f"{checkpoint_cluster.router_url}/v1/completions", timeout=120,
                        json={"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == checkpoint_cluster.model and len(answer.json()["choices"][0]["logprobs"]["tokens"])
