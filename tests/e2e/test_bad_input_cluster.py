"""Bad input through the router answers 4xx OpenAI-style errors, and the cluster keeps serving."""

from __future__ import annotations

import httpx
import pytest

from engine.model.tokenizer import ByteTokenizer, ChatMessage
from tests.e2e.harness import choice_token_ids

pytestmark = pytest.mark.e2e

GOOD_PROMPT = "A healthy request after the bad ones."


def _bad_requests(model: str) -> dict[str, tuple[str, dict | bytes]]:
    too_long = "x" * 40_000  # kimi-k3.1-mini: max_context 32768 tokens, one token per byte
    return {
        "malformed-json": ("/v1/completions", b'{"model": "m", "prompt": "unterminated'),
        "json-not-object": ("/v1/chat/completions", b"[1, 2, 3]"),
        "prompt-wrong-type": ("/v1/completions", {"model": model, "prompt": {"text": "hi"}, "max_tokens": 4}),
        "max-tokens-string": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": "many"}),
        "messages-not-list": ("/v1/chat/completions", {"model": model, "messages": "hello"}),
        "empty-messages": ("/v1/chat/completions", {"model": model, "messages": [], "max_tokens": 4}),
        "prompt-over-context": ("/v1/completions", {"model": model, "prompt": too_long, "max_tokens": 4}),
        "chat-over-context": ("/v1/chat/completions", {"model": model, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": too_long}]}),
        "max-tokens-absurd": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 10**12}),
        "max-tokens-negative": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -5}),
        "temperature-negative": ("/v1/completions", {"model": model, "prompt": "hi", "temperature": -1.0}),
        "presence-penalty-out-of-range": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4,
                                                              "presence_penalty": 2.5}),
        "repetition-penalty-zero": ("/v1/chat/completions", {"model": model, "max_tokens": 4, "repetition_penalty": 0,
                                                             "messages": [{"role": "user", "content": "hi"}]}),
        "unknown-model": ("/v1/chat/completions", {"model": "gpt-unknown", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]}),
    }


@pytest.mark.parametrize("case", list(_bad_requests("m")), ids=list(_bad_requests("m")))
def test_bad_input_is_a_4xx_openai_error(cluster, case):
    path, body = _bad_requests(cluster.model)[case]
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(f"{cluster.router_url}{path}", timeout=120, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if case == "unknown-model":
        assert response.status_code in (400, 404)
    error = response.json()["error"]
    if "penalty" in case:
        assert response.status_code == 400 and error["param"] == case.split("-penalty")[0] + "_penalty"
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] and error["code"] == response.status_code
    assert httpx.get(f"{cluster.router_url}/health", timeout=10).status_code == 200


def test_openai_client_raises_and_the_cluster_keeps_serving(cluster):
    import openai  # here, not atop the module: the fast tier collects this module and runs none of it

    client = cluster.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=cluster.model, prompt="hi", max_tokens=-1)
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        client.chat.completions.create(model="gpt-unknown", messages=[{"role": "user", "content": "hi"}])
    expected = cluster.oracle(GOOD_PROMPT, 8)
    result = client.completions.create(model=cluster.model, prompt=GOOD_PROMPT, max_tokens=8, temperature=0)
    assert choice_token_ids(result.choices[0]) == list(expected.token_ids)
    assert not cluster.cluster.dead(), f"processes died: {cluster.cluster.dead()}"


def _error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and "Traceback" not in response.text
    return error


def test_numeric_header_of_5000_digits_and_content_less_message_are_400_json(cluster):
    body = {"model": cluster.model, "prompt": "hi", "max_tokens": 2}
    response = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=120,
                          headers={"X-Expected-Context-Tokens": "9" * 5000})
    assert _error_of(response, 400)["param"].lower() == "x-expected-context-tokens"
    for message in ({"role": "user"}, {"role": "user", "content": None}):
        response = httpx.post(f"{cluster.router_url}/v1/chat/completions", timeout=120,
                              json={"model": cluster.model, "messages": [message], "max_tokens": 2})
        assert _error_of(response, 400)["param"] == "messages.0.content"
    assert httpx.get(f"{cluster.router_url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("param,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}), ("tool_choice", "required"),
])
def test_unimplemented_parameters_are_refused_by_name_through_the_router(cluster, param, value):
    """The reference nodes refuse what they do not implement; the node's 400 reaches the client as it is."""
    import openai

    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, **{param: value})
    assert info.value.body["param"] == param and param in info.value.body["message"]
    neutral = {"logit_bias": {}, "tools": [], "response_format": {"type": "text"}, "tool_choice": "none"}[param]
    ok = client.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, **{param: neutral})
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_unknown_routes_and_methods_are_openai_errors(cluster):
    assert "/v1/nope" in _error_of(httpx.get(f"{cluster.router_url}/v1/nope", timeout=30), 404)["message"]
    _error_of(httpx.delete(f"{cluster.router_url}/v1/models", timeout=30), 405)
    nested = b'{"model": "m", "prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _error_of(httpx.post(f"{cluster.router_url}/v1/completions", content=nested, timeout=30,
                         headers={"Content-Type": "application/json"}), 400)
    for node in cluster.nodes:
        _error_of(httpx.get(f"{node.url}/v1/nope", timeout=30), 404)


def test_penalties_are_honoured_through_the_router(cluster):
    """The reference nodes implement the penalties: accepted through the router (prefill leg and decode leg alike),
    the answer is whole."""
    client = cluster.client()
    result = client.completions.create(model=cluster.model, prompt=GOOD_PROMPT, max_tokens=8, temperature=0,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    assert len(choice_token_ids(result.choices[0])) == 8


NUL_PROMPT = "Byte zero \x00 travels as text."
NUL_TURNS = [{"role": "user", "content": "Answer with a zero byte."},
             {"role": "assistant", "content": "Here it is: \x00."},  # an answer holding byte 0, sent back
             {"role": "user", "content": "And once more\x00"}]


def test_nul_in_model_text_is_served_as_the_oracle_answers(cluster):
    """Byte 0 is text a byte-level model writes, and an agent sends the conversation back: a prompt holding NUL and
    a chat whose earlier answer holds it are served through the router (prefill and decode legs) and straight by a
    node with the oracle's tokens (`pdcluster generate` on the same text); the node tokenizes the turns as the
    reference chat template does."""
    client = cluster.client()
    expected = cluster.oracle(NUL_PROMPT, 4)
    result = client.completions.create(model=cluster.model, prompt=NUL_PROMPT, max_tokens=4, temperature=0)
    assert choice_token_ids(result.choices[0]) == list(expected.token_ids)
    node = cluster.nodes_of(pool="tp")[0].url
    direct = httpx.post(f"{node}/v1/completions", timeout=300,
                        json={"model": cluster.model, "prompt": NUL_PROMPT, "max_tokens": 4, "temperature": 0})
    assert direct.status_code == 200, direct.text
    assert direct.json()["choices"][0]["token_ids"] == list(expected.token_ids)

    tokens = httpx.post(f"{node}/tokenize", json={"messages": NUL_TURNS}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    template = ByteTokenizer().apply_chat_template([ChatMessage(m["role"], m["content"]) for m in NUL_TURNS])
    assert tokens.json()["tokens"] == template and template.count(0) == 2
    expected = cluster.oracle_chat(NUL_TURNS, 4)
    answer = client.chat.completions.create(model=cluster.model, messages=NUL_TURNS, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.completion_tokens == len(expected.token_ids)
    assert answer.usage.prompt_tokens == len(template)


@pytest.mark.parametrize("field,value", [("model", "m\x00"), ("user", "u\x00"), ("cache_salt", "s\x00"),
                                         ("stop", ["\x00"])])
def test_nul_in_an_identifier_or_control_field_is_a_400_at_router_and_node(cluster, field, value):
    body = {"model": cluster.model, "prompt": "hi", "max_tokens": 2, field: value}
    for url in (cluster.router_url, cluster.nodes_of(pool="tp")[0].url):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        error = _error_of(response, 400)
        assert error["param"] == field and "NUL" in error["message"] and "\\u0000" not in response.text
