"""Bad input through the router answers 4xx OpenAI-style errors, and the cluster keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

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
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] and error["code"] == response.status_code
    assert httpx.get(f"{cluster.router_url}/health", timeout=10).status_code == 200


def test_openai_client_raises_and_the_cluster_keeps_serving(cluster):
    client = cluster.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=cluster.model, prompt="hi", max_tokens=-1)
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        client.chat.completions.create(model="gpt-unknown", messages=[{"role": "user", "content": "hi"}])
    expected = cluster.oracle(GOOD_PROMPT, 8)
    result = client.completions.create(model=cluster.model, prompt=GOOD_PROMPT, max_tokens=8, temperature=0)
    assert choice_token_ids(result.choices[0]) == list(expected.token_ids)
    assert not cluster.cluster.dead(), f"processes died: {cluster.cluster.dead()}"
