"""OpenAI-compatible request and response models shared by the prefill and decode nodes.

Shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py) so a router speaks to our
nodes and to vLLM the same way:
- requests: `/v1/completions` (prompt as text or token ids) and `/v1/chat/completions` (messages);
  unknown fields are accepted and ignored, as vLLM does; `n` must be 1.
- `kv_transfer_params` rides in the request body (router -> node) and in the response body
  (prefill -> router, and on the final streamed chunk) exactly as vLLM's NixlConnector uses it.
- usage carries `prompt_tokens_details.cached_tokens`.
Invariant: every field a client may send is validated here, so handlers receive typed values only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KVParamsField = dict[str, Any] | None
"""Request/response `kv_transfer_params`: parsed into kv_transfer's typed params by the node."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    """0 only with echo or prompt_logprobs: the prompt is scored, nothing is generated."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    """vLLM's extension: sample among the k most likely tokens (0 or -1: no limit)."""
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    """vLLM's extension: log-probs of the prompt tokens with this many alternatives."""
    kv_transfer_params: KVParamsField = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got n={value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        return [value] if isinstance(value, str) else value

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
    max_completion_tokens: int | None = Field(default=None, ge=1)
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AbortRequests(BaseModel):
    """POST /abort_requests body."""

    request_ids: list[str] = Field(min_length=1)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt or chat messages."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
