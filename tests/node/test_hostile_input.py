"""Hostile bodies sent straight to a node (prefill app, real rank process of the test backend, in-process HTTP):
a lone UTF-16 surrogate in any string or field name, NUL in a field name or a string that is not text for the model
(an id, a name, `model`, `user`, `cache_salt`, `stop`), JSON nested past `MAX_JSON_DEPTH`, a bad X-Request-Id,
too many or too long stop strings, a bad `cache_salt` or tenant header: every route answers 400 as OpenAI error
JSON naming the field, never a 500 (serving/json_guard.py, node/serving.py `GuardMiddleware`). NUL in text for the
model (prompt, message content) is accepted and tokenized as byte 0."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from prefill_node.app import create_app
from prefill_node.settings import Settings
from serving.json_guard import MAX_JSON_DEPTH, check_body
from serving.errors import APIError
from serving.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.node.nodes import TEST_CLUSTER_SECRET, TOY

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/abort_requests"]


@pytest.fixture(scope="module")
def client():
    settings = Settings(backend=TOY, num_rows=16, max_context=4096, engine_id="hostile-test", port=8125,
                        cluster_secret=TEST_CLUSTER_SECRET)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


PLACES = {  # where a hostile client may put a string: (body with `@` where the character goes, param named)
    "prompt": (b'{"prompt": "a@b", "max_tokens": 2}', "prompt"),
    "message": (b'{"messages": [{"role": "user", "content": "@"}]}', "messages"),
    "model": (b'{"prompt": "ab", "model": "m@", "max_tokens": 2}', "model"),
    "stop": (b'{"prompt": "ab", "stop": ["@"], "max_tokens": 2}', "stop"),
    "user": (b'{"prompt": "ab", "user": "u@", "max_tokens": 2}', "user"),
    "cache-salt": (b'{"prompt": "ab", "cache_salt": "s@", "max_tokens": 2}', "cache_salt"),
    "message-name": (b'{"messages": [{"role": "user", "name": "@", "content": "x"}]}', "messages"),
    "role": (b'{"messages": [{"role": "user@", "content": "x"}]}', "messages"),
    "key": (b'{"prompt": "ab", "@": 1}', None),
    "nested-key": (b'{"prompt": "ab", "response_format": {"type@": "text"}}', "response_format"),
    "ids": (b'{"request_ids": ["r@"]}', "request_ids"),
}
MODEL_TEXT = ("prompt", "message")
"""Places whose text goes to the tokenizer: NUL is accepted there (test_nul_in_text_for_the_model_is_accepted)."""
BODIES = {
    **{f"surrogate-{name}": (body.replace(b"@", b"\\ud800"), param) for name, (body, param) in PLACES.items()},
    **{f"nul-{name}": (body.replace(b"@", b"\\u0000"), param) for name, (body, param) in PLACES.items()
       if name not in MODEL_TEXT},
    "deep-params": (b'{"prompt": "ab", "kv_transfer_params": ' + b'{"a": ' * 300 + b'1' + b'}' * 300 + b'}',
                    "kv_transfer_params"),
    "deep-list": (b'{"prompt": "ab", "stop": ' + _nested(MAX_JSON_DEPTH + 1) + b'}', "stop"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BODIES))
def test_every_route_answers_400_naming_the_field(client, route, name):
    body, param = BODIES[name]
    resp = client.post(route, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and error["param"] == param
    assert "\\ud" not in resp.text and "\\u0000" not in resp.text  # the bad value is never echoed


@pytest.mark.parametrize("route,body,want", [
    ("/tokenize", b'{"prompt": "a\\u0000b", "add_special_tokens": false}', [97, 0, 98]),
    ("/tokenize", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\u0000"}]}]}', None),
    ("/v1/completions", b'{"prompt": ["a\\u0000b"], "max_tokens": 2}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                             b'"content": "x\\u0000y"}, {"role": "user", "content": "\\u0000"}], "max_tokens": 2}',
     None),
], ids=["tokenize-prompt", "tokenize-part", "completions-list", "chat-answer-sent-back"])
def test_nul_in_text_for_the_model_is_accepted(client, route, body, want):
    """An answer holding byte 0 (a byte-level model writes it) comes back in the next turn: the node serves it."""
    resp = client.post(route, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    if want is not None:
        assert resp.json()["tokens"] == want
    elif route == "/tokenize":
        assert 0 in resp.json()["tokens"]


def test_a_pair_of_surrogates_is_a_character_and_passes(client):
    resp = client.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"})
    assert resp.status_code == 200 and resp.json()["tokens"] == list("\U0001f600".encode())


@pytest.mark.parametrize("request_id", [b"a" * 257, b"a b", "caf\u00e9".encode()])
def test_a_bad_request_id_is_400(client, request_id):
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": request_id})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize("stop", [["s"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)]])
def test_stop_strings_are_capped(client, stop):
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop": stop})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop", resp.text
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop": stop[:MAX_STOP_STRINGS]
                                              if len(stop) > 1 else ["x" * MAX_STOP_CHARS]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("headers,body,param", [
    ({"x-pdcluster-tenant": "not-hex"}, {}, "x-pdcluster-tenant"),
    ({"x-pdcluster-tenant": "a" * 65}, {}, "x-pdcluster-tenant"),
    ({}, {"cache_salt": ""}, "cache_salt"),
    ({}, {"cache_salt": "s" * 257}, "cache_salt"),
    ({}, {"cache_salt": 7}, "cache_salt"),
])
def test_bad_tenant_or_cache_salt_is_a_400_naming_it(client, headers, body, param):
    resp = client.post("/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 1, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    good = client.post("/v1/completions", headers={"x-pdcluster-tenant": "ab" * 16},
                       json={"prompt": "hi", "max_tokens": 1, "cache_salt": "mine"})
    assert good.status_code == 200, good.text


def test_check_body_bounds_depth_without_recursion():
    check_body(b'{"a": ' + _nested(MAX_JSON_DEPTH - 1) + b'}')
    with pytest.raises(APIError) as err:
        check_body(b'{"a": ' + _nested(MAX_JSON_DEPTH) + b'}')
    assert err.value.param == "a"
    check_body(b"not json")  # the framework's own 400
