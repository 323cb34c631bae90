"""OpenAI-compatible request and response models shared by the prefill and decode nodes.

Shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py) so a router speaks to our
nodes and to vLLM the same way:
- requests: `/v1/completions` (prompt as text or token ids) and `/v1/chat/completions` (messages); `n` must
  be 1. Every parameter is honoured or refused: fields this server does not implement (`tools`,
  `response_format`, `logit_bias`, ...) are kept in `model_extra` and `refused_parameter()` names
  the first one whose value is not the inert default (the node answers 400 naming it); unknown fields are
  refused the same way (vLLM would ignore them silently).
- a user, system or developer message needs `content` (a string or a non-empty list of parts); message
  fields the reference chat template does not render (`name`, `tool_calls`, ...) are refused.
- `kv_transfer_params` rides in the request body (router -> node) and in the response body
  (prefill -> router, and on the final streamed chunk) exactly as vLLM's NixlConnector uses it.
- usage carries `prompt_tokens_details.cached_tokens`: tokens reused from the prefix cache of the request's own
  tenant and `cache_salt` (vLLM's extension, 1..256 characters), never another's (node/textgen.py `cache_salt`).
Invariant: every field a client may send is validated here, so handlers receive typed values only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

KVParamsField = dict[str, Any] | None
"""Request/response `kv_transfer_params`: parsed into kv_transfer's typed params by the node."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

INERT_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "length_penalty": (None, 1), "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
    "min_tokens": (None, 0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "structured_outputs": (None,), "logits_processors": (None,),
    "prompt_embeds": (None,), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,), "reasoning_effort": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "return_tokens_as_token_ids": (None, False), "priority": (None, 0),
    "vllm_xargs": (None,), "mm_processor_kwargs": (None,), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "top_logprobs": (None,), "max_completion_tokens": (None,),
    "echo": (None, False), "request_id": (None,),
}
"""Parameters of OpenAI's or vLLM's API this server does not implement, with the values that ask for nothing
(a request may carry those). Fields a request model declares are honoured and never looked up here."""


def _is_inert(value: Any, inert: tuple[Any, ...]) -> bool:
    """`value` is one of `inert` (booleans compared by identity: 0 is not False)."""
    for candidate in inert:
        if isinstance(value, bool) or isinstance(candidate, bool):
            if value is candidate:
                return True
        elif value == candidate:
            return True
    return False


class _SamplingFields(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    """0 only with echo or prompt_logprobs: the prompt is scored, nothing is generated."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    """vLLM's extension: sample among the k most likely tokens (0 or -1: no limit)."""
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    """vLLM's extension: log-probs of the prompt tokens with this many alternatives."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    """vLLM's extension. The penalties' ranges are engine.api.SamplingParams' (a node answers 400 naming one)."""
    kv_transfer_params: KVParamsField = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's extension: requests share cached prefix blocks only with requests of the same salt (and tenant)."""
    return_token_ids: bool = False
    """vLLM's extension: stream chunks carry the `token_ids` they cover (non-streamed completion choices always do)."""
    resume_token_ids: list[int] | None = None
    """pdcluster's extension (what the router sends when a stream moves to another instance): the tokens this
    request's earlier stream already sent, appended to the prompt; generation continues from the next one exactly
    as the uninterrupted stream would (the same seed is needed for sampling). `max_tokens` still counts the whole
    completion; usage counts these tokens as completion tokens; the stream sends only what follows them."""

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got n={value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        """At most MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters: a node looks for each one at
        every token (node/textgen.py `TextAssembler`), so their count and length bound that work."""
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stops

    def refused_parameter(self) -> str | None:
        """The first parameter this server does not implement whose value asks for something (None: none)."""
        for name, value in (self.model_extra or {}).items():
            inert = INERT_VALUES.get(name)
            if inert is None or not _is_inert(value, inert):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (list, str)):
            if len(value) != 1:
                raise ValueError(f"batched prompts are not supported ({len(value)} prompts); send one per request")
            value = value[0]
        if isinstance(value, list) and any(isinstance(tok, bool) or not isinstance(tok, int) for tok in value):
            raise ValueError("prompt token ids must be integers")
        return value


MESSAGE_INERT_VALUES: dict[str, tuple[Any, ...]] = {"name": (None,), "tool_calls": (None, []),
                                                    "function_call": (None,), "tool_call_id": (None,),
                                                    "refusal": (None,), "reasoning_content": (None,)}
"""Message fields the reference chat template does not render, with the values that carry nothing."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_and_fields(self) -> "ChatMessage":
        if self.role in ("user", "system", "developer") and (self.content is None or self.content == []):
            raise PydanticCustomError("missing_content", "a {role} message needs content (a string or a non-empty "
                                      "list of parts)", {"role": self.role})
        for name, value in (self.model_extra or {}).items():
            if not _is_inert(value, MESSAGE_INERT_VALUES.get(name, ())):
                raise PydanticCustomError("unsupported_field", "message field {name!r} is not supported by this "
                                          "server's chat template", {"name": name})
        return self

    def text(self) -> str:
        """The message's text: a string, or the concatenated text parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"unsupported content part type {part.get('type')!r}; only 'text' parts")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> "ChatCompletionRequest":
        # OpenAI's newer name wins when both are present (vLLM does the same).
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


PromptLogprobEntry = dict[str, dict[str, Any]] | None
"""vLLM's prompt_logprobs entry: token id (as a string) -> {logprob, rank, decoded_token}; None for the first."""


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[PromptLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: KVParamsField = None


class CompletionStreamChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[PromptLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda ids: ids is None)
    """The token ids this chunk covers, only when the request asked (`return_token_ids`)."""


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: KVParamsField = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    prompt_logprobs: list[PromptLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: KVParamsField = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    prompt_logprobs: list[PromptLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda ids: ids is None)
    """The token ids this chunk covers, only when the request asked (`return_token_ids`)."""


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: KVParamsField = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdcluster"
    root: str | None = None
    max_model_len: int | None = None
    weights_fingerprint: str | None = None
    """pdcluster reference nodes: weights + tokenizer identity (router pairing refuses a P/D pair that differs)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AbortRequests(BaseModel):
    """POST /abort_requests body."""

    request_ids: list[str] = Field(min_length=1)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt or chat messages. Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    """Must be the served model when given (404 otherwise)."""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    """A prompt's special tokens (the BOS a checkpoint's tokenizer adds); chat messages get the template's own."""
    add_generation_prompt: bool = True
    """Chat: open the assistant's turn after the messages, as a chat completion does."""

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
