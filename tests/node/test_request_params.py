"""Every request parameter is honoured or refused by name (node side, no engine needed): the penalties reach the
engine's SamplingParams as sent, out of their range a 400 naming them. Every error of a node app is OpenAI JSON:
unknown routes and methods, malformed or deeply nested bodies, unexpected exceptions (no traceback, no internal
address), content-less messages, unsupported parameters.

`prepare()` is what both node kinds run on every request, so it is tested directly; the HTTP edge is the real
prefill and decode apps, built but not started (no rank processes: the checks here come before the engine).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from decode_node.app import create_app as create_decode_app
from decode_node.settings import Settings as DecodeSettings
from engine.model.tokenizer import ByteTokenizer
from node.tokenizer import ServerTokenizer
from node.textgen import Limits, prepare
from prefill_node.app import create_app as create_prefill_app
from prefill_node.settings import Settings as PrefillSettings
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest

TOKENIZER = ServerTokenizer(ByteTokenizer(), 512, ByteTokenizer.eos_token_id)
LIMITS = Limits(max_context=256)
MESSAGES = [{"role": "user", "content": "hi"}]

REFUSED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"5": 10}),
    ("best_of", 2),
    ("min_tokens", 3),
    ("include_stop_str_in_output", True),
    ("guided_json", {"type": "object"}),
    ("skip_special_tokens", False),
    ("functions", [{"name": "f"}]),
    ("no_such_parameter", 1),
]
INERT = [("tools", []), ("tool_choice", "none"), ("logit_bias", {}), ("response_format", {"type": "text"}),
         ("best_of", 1), ("parallel_tool_calls", True), ("min_tokens", 0), ("skip_special_tokens", True),
         ("suffix", None)]


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hello", "max_tokens": 4, **fields})


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 4, **fields})


def _prepare(req):
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
    return prepare(req, kind, "r1", "m", TOKENIZER, LIMITS)


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize("name,value", REFUSED, ids=[c[0] for c in REFUSED])
def test_unimplemented_parameters_are_refused_by_name(endpoint, name, value):
    req = (_completion if endpoint == "completion" else _chat)(**{name: value})
    with pytest.raises(APIError) as info:
        _prepare(req)
    assert info.value.status == 400 and info.value.param == name and name in info.value.message


@pytest.mark.parametrize("name,value", INERT, ids=[f"{c[0]}={c[1]!r}" for c in INERT])
def test_default_values_of_unimplemented_parameters_are_accepted(name, value):
    for req in (_completion(**{name: value}), _chat(**{name: value})):
        assert _prepare(req).sampling.max_tokens == 4


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize("name,value", [
    ("presence_penalty", 0.5), ("presence_penalty", -2), ("frequency_penalty", -0.1), ("frequency_penalty", 2.0),
    ("repetition_penalty", 1.2), ("repetition_penalty", 0.5),
], ids=lambda v: str(v))
def test_penalties_reach_the_engine_as_sent(endpoint, name, value):
    prepared = _prepare((_completion if endpoint == "completion" else _chat)(**{name: value}))
    assert getattr(prepared.sampling, name) == value


def test_absent_or_null_penalties_are_off():
    for sampling in (_prepare(_completion()).sampling, _prepare(_chat(presence_penalty=None)).sampling):
        assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0, 0, 1)


@pytest.mark.parametrize("name,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("frequency_penalty", 3), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
], ids=lambda v: str(v))
def test_penalties_out_of_range_are_a_400_naming_them(name, value):
    for req in (_completion(**{name: value}), _chat(**{name: value})):
        with pytest.raises(APIError) as info:
            _prepare(req)
        assert info.value.status == 400 and info.value.param == name and name in info.value.message


@pytest.mark.parametrize("fields,param", [
    ({"echo": True}, "echo"), ({"top_logprobs": 2}, "top_logprobs"), ({"max_completion_tokens": 3},
                                                                       "max_completion_tokens"),
], ids=["echo", "top_logprobs", "max_completion_tokens"])
def test_chat_only_or_completions_only_fields_are_refused_on_the_other_endpoint(fields, param):
    req = _chat(**fields) if param == "echo" else _completion(**fields)
    with pytest.raises(APIError) as info:
        _prepare(req)
    assert info.value.param == param


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened():
    opened = _prepare(_chat()).prompt_token_ids
    closed = _prepare(_chat(add_generation_prompt=False)).prompt_token_ids
    assert opened[:len(closed)] == closed and ByteTokenizer().decode(opened[len(closed):]) == "assistant\n"


@pytest.mark.parametrize("message", [
    {"role": "user"}, {"role": "user", "content": None}, {"role": "user", "content": []},
    {"role": "system", "content": None}, {"role": "user", "content": "x", "name": "bob"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
], ids=["user-no-content", "user-null", "user-no-parts", "system-null", "name", "tool-calls"])
def test_messages_need_content_and_only_rendered_fields(message):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [message]})


def test_assistant_message_may_be_empty():
    req = _chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
                          {"role": "user", "content": "b"}])
    assert _prepare(req).prompt_token_ids


@pytest.mark.parametrize("fields,ok", [
    ({"max_tokens": 0}, False), ({"max_tokens": 0, "echo": True}, True),
    ({"max_tokens": 0, "prompt_logprobs": 1}, True), ({"seed": 2**63}, False), ({"seed": -(2**63)}, True),
], ids=["zero", "zero-echo", "zero-prompt-logprobs", "seed-past-int64", "seed-int64-min"])
def test_numeric_bounds(fields, ok):
    if ok:
        _prepare(_completion(**fields))
        return
    with pytest.raises((APIError, ValidationError)) as info:
        _prepare(_completion(**fields))
    if isinstance(info.value, APIError):
        assert info.value.param == "max_tokens"


def test_prompt_log_probs_are_not_served_from_transferred_kv():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_request_id": "r",
              "remote_block_ids": [[0]], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
    with pytest.raises(APIError) as info:
        _prepare(_completion(echo=True, logprobs=1, kv_transfer_params=params))
    assert info.value.param == "kv_transfer_params"


# ---------------------------------------------------------------- the HTTP edge of both node apps


@pytest.fixture(params=["prefill", "decode"])
def client(request):
    secret = "t" * 64
    if request.param == "prefill":
        app = create_prefill_app(PrefillSettings(cluster_secret=secret))
    else:
        app = create_decode_app(DecodeSettings(cluster_secret=secret))
    return TestClient(app, raise_server_exceptions=False)  # lifespan not run: no ranks


def _assert_openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert "Traceback" not in resp.text
    return error


def test_unknown_route_and_method(client):
    assert "/v1/nope" in _assert_openai_error(client.post("/v1/nope", json={}), 404)["message"]
    _assert_openai_error(client.get("/v1/completions"), 405)


@pytest.mark.parametrize("depth", [2000, 100_000])
def test_deeply_nested_json(client, depth):
    body = '{"prompt": "x", "kv_transfer_params": ' + '{"a":' * depth + "1" + "}" * depth + "}"
    _assert_openai_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                         400)


def test_content_less_user_message(client):
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}], "max_tokens": 2})
    assert _assert_openai_error(resp, 400)["param"] == "messages.0"


def test_huge_integer_in_body(client):
    body = '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"
    _assert_openai_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                         400)


def test_unexpected_exception_is_a_clean_500(client, monkeypatch):
    def boom(_request):
        raise RuntimeError("lease 3f2a9c0d1e2b4a5f9c8d7e6f5a4b3c2d on 10.1.2.3:5600 broke")

    monkeypatch.setattr("node.app.runtime_of", boom)
    error = _assert_openai_error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert error["message"] == "internal server error"
    assert "10.1.2.3" not in client.post("/v1/completions", json={"prompt": "x"}).text


def test_the_metrics_port_answers_errors_as_openai_json():
    from node.serving import MetricsServer

    metrics = TestClient(MetricsServer("127.0.0.1", 0, lambda: b"x 1\n").server.config.app)  # not started
    _assert_openai_error(metrics.get("/nope"), 404)
    _assert_openai_error(metrics.post("/metrics"), 405)
    assert metrics.get("/metrics").text == "x 1\n"
