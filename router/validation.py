"""Light request validation at the router edge; everything else passes through to the node unchanged.

Checked: the body is a JSON object within `max_body_bytes`, nested at most `MAX_JSON_DEPTH` deep, with NUL only in
text for the model (the nodes' rule, serving/json_guard.py: `prompt`, message `content`, tool call `arguments`; a
NUL in a name, id, control field or `stop` is a 400; lone surrogates are invalid JSON to the parser); `model` names a served model (absent or null: the
cluster's one model, filled in for the nodes, as vLLM serves its one model; with several, a 400); `messages`
(chat) or `prompt` (completions) is present and well typed, and a user/system/developer message has content;
`max_tokens` / `max_completion_tokens` are integers in [1, limit], or 0 for a request that only scores its
prompt (`echo` or `prompt_logprobs`, as the nodes and vLLM allow); `n` is 1; `stream` is a bool and
`stream_options` an object. Other parameters are not checked here (the penalties' ranges, or those the reference
engine does not implement: `tools`, `logit_bias`, ...): vLLM pools honour them, and our nodes answer a 400 naming
the parameter (out of range, or not implemented), which the router relays unchanged. Client-supplied
`kv_transfer_params` are removed here (security: only the router speaks that protocol to nodes).
Errors are `APIError(400|404|413)` with the offending param named (503 for a request without a model before any
decode instance has reported one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from serving.errors import APIError
from serving.json_guard import nul_error, refused_nul, strings

Endpoint = Literal["chat", "completions"]
ROUTER_ONLY_FIELDS = ("kv_transfer_params",)
MAX_JSON_DEPTH = 254
"""Deepest nesting of a request body (objects and arrays; the body itself is level 1): the most orjson writes, so
the most both legs can send on (tests/router/test_protocol_hygiene.py pins it)."""
NEEDS_CONTENT = ("user", "system", "developer")


# Not frozen: built per request, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about
# twice a plain one on the hot path. Nothing mutates it once built (changes go through dataclasses.replace).
@dataclass
class ValidRequest:
    endpoint: Endpoint
    model: str
    body: dict[str, Any]
    """The client's body minus router-only fields, otherwise unchanged."""
    is_stream: bool

    @property
    def scores_prompt(self) -> bool:
        return scores_prompt(self.body)


def scores_prompt(body: dict[str, Any]) -> bool:
    """The answer carries prompt log-probs (`echo` or `prompt_logprobs`): they are computed where the prompt is
    prefilled, so such a request is served colocated (a remote prefill hands over KV, not prompt log-probs)."""
    return body.get("echo") is True or body.get("prompt_logprobs") is not None


def parse_body(raw: bytes, max_body_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: within `max_body_bytes`, valid UTF-8 JSON (a lone surrogate, escaped or not, is
    not), nested at most `MAX_JSON_DEPTH` deep, and NUL only in text for the model (serving/json_guard.py)."""
    if len(raw) > max_body_bytes:
        raise APIError(413, f"request body is {len(raw)} bytes, more than the limit of {max_body_bytes}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    # Each check runs only when the bytes could hold what it looks for. orjson writes about six times faster than
    # it reads, so the depth check costs a sixth of the parse; counting brackets (bytes.count) cost more than the
    # parse itself. A one-byte `in` is a memchr; the NUL search runs only on bodies with an escape.
    if len(raw) > 2 * MAX_JSON_DEPTH:
        try:
            orjson.dumps(body)  # what both legs do with it: orjson refuses to write past MAX_JSON_DEPTH levels
        except orjson.JSONEncodeError as exc:
            if "recursion" in str(exc).lower():
                raise APIError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
            raise APIError(400, f"request body cannot be passed on: {str(exc)[:200]}") from None
    if b"\\" in raw and b"\\u0000" in raw:
        for path, text, is_key in strings(body, MAX_JSON_DEPTH):
            if refused_nul(path, text, is_key):
                raise nul_error(path, is_key)
    return body


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", f"messages.{i}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                           f"messages.{i}.content")
        if message["role"] in NEEDS_CONTENT and (content is None or content == []):
            raise APIError(400, f"messages[{i}] ({message['role']}) needs content: a string or a non-empty list of "
                                f"parts", f"messages.{i}.content")


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in value)


def _check_prompt(prompt: Any) -> None:
    ok = (isinstance(prompt, str) or _is_int_list(prompt)
          or (isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str) for p in prompt))
          or (isinstance(prompt, list) and bool(prompt) and all(_is_int_list(p) for p in prompt)))
    if not ok:
        raise APIError(400, "prompt must be a string, a list of strings, or (lists of) token ids", "prompt")


def _check_sampling(body: dict[str, Any], max_tokens_limit: int) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= max_tokens_limit:
            raise APIError(400, f"{key} must be an integer in [1, {max_tokens_limit}], got {value!r}", key)
        if value == 0 and not scores_prompt(body):
            raise APIError(400, f"{key} must be at least 1 (0 only with echo or prompt_logprobs: the prompt is "
                                f"scored, nothing is generated)", key)
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise APIError(400, f"only n=1 is supported, got n={n!r}", "n")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise APIError(400, f"stream must be a boolean, got {body['stream']!r}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise APIError(400, f"{key} must be a number, got {value!r}", key)


def _model(body: dict[str, Any], known_models: set[str]) -> str:
    """The request's model: as sent, or absent (or null) the cluster's one model, as vLLM serves its one model."""
    model = body.get("model")
    if model is None:
        if len(known_models) == 1:
            return next(iter(known_models))
        if not known_models:
            raise APIError(503, "no decode instance has reported the model it serves yet; retry later", "model",
                           "service_unavailable")
        raise APIError(400, f"model is required: this cluster serves several models: {sorted(known_models)}",
                       "model")
    if not isinstance(model, str) or not model:
        raise APIError(400, f"model must be a non-empty string, got {model!r}", "model")
    return model


def validate(body: dict[str, Any], endpoint: Endpoint, known_models: set[str], max_tokens_limit: int) -> ValidRequest:
    model = _model(body, known_models)
    if model not in known_models:
        raise APIError(404, f"model {model!r} does not exist; served: {sorted(known_models)}", "model",
                       "model_not_found")
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise APIError(400, "prompt is required", "prompt")
        _check_prompt(body["prompt"])
    _check_sampling(body, max_tokens_limit)
    clean = {k: v for k, v in body.items() if k not in ROUTER_ONLY_FIELDS}
    clean["model"] = model  # a request without one names the cluster's model to the nodes
    return ValidRequest(endpoint=endpoint, model=model, body=clean, is_stream=bool(body.get("stream")))
