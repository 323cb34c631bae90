"""Build OpenAI response bodies and stream chunks from generated pieces (completion and chat alike).

Streams follow vLLM: chat streams open with a `role: assistant` delta; every piece is one chunk with
`usage: null`; the last content chunk carries `finish_reason`; with `stream_options.include_usage` a final
chunk with empty `choices` carries the usage. The `[DONE]` terminator is added by serving.sse.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from engine.outputs import TokenEvent
from node.logprobs import Detokenizer, chat_logprobs, completion_logprobs
from node.textgen import GenerationResult, Piece, PreparedRequest
from serving.protocol import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    new_id,
)


def response_id(prepared: PreparedRequest) -> str:
    return f"{'chatcmpl' if prepared.kind == 'chat' else 'cmpl'}-{prepared.request_id}"


def usage_of(prepared: PreparedRequest, result: GenerationResult) -> UsageInfo:
    return UsageInfo.of(len(prepared.prompt_token_ids), len(result.tokens), result.num_cached_tokens)


def _logprobs(prepared: PreparedRequest, tokenizer: Detokenizer, events: Sequence[TokenEvent],
              prefix_ids: Sequence[int] = ()) -> Any:
    """The choice's (or chunk's) log-probs in the endpoint's format, or None when the request asked for none."""
    if prepared.sampling.logprobs is None:
        return None
    if prepared.kind == "chat":
        return chat_logprobs(tokenizer, events)
    return completion_logprobs(tokenizer, events, prefix_ids)


def final_response(prepared: PreparedRequest, result: GenerationResult, tokenizer: Detokenizer,
                   kv_transfer_params: dict[str, Any] | None = None) -> BaseModel:
    """The non-streaming body."""
    usage = usage_of(prepared, result)
    logprobs = _logprobs(prepared, tokenizer, result.tokens)
    if prepared.kind == "chat":
        choice = ChatCompletionChoice(message=ChatMessageOut(content=result.text), logprobs=logprobs,
                                      finish_reason=result.finish_reason)
        return ChatCompletionResponse(id=response_id(prepared), model=prepared.model, choices=[choice],
                                      usage=usage, kv_transfer_params=kv_transfer_params)
    choice = CompletionChoice(text=result.text, logprobs=logprobs, finish_reason=result.finish_reason,
                              token_ids=result.token_ids)
    return CompletionResponse(id=response_id(prepared), model=prepared.model, choices=[choice], usage=usage,
                              kv_transfer_params=kv_transfer_params)


def _chunk(prepared: PreparedRequest, rid: str, text: str | None, finish: str | None,
           role: bool = False, logprobs: Any = None) -> BaseModel:
    if prepared.kind == "chat":
        delta = DeltaMessage(role="assistant" if role else None, content=text)
        choice = ChatStreamChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatCompletionStreamResponse(id=rid, model=prepared.model, choices=[choice])
    choice = CompletionStreamChoice(text=text or "", logprobs=logprobs, finish_reason=finish)
    return CompletionStreamResponse(id=rid, model=prepared.model, choices=[choice])


async def stream_chunks(prepared: PreparedRequest, pieces: AsyncIterator[Piece], result: GenerationResult,
                        tokenizer: Detokenizer) -> AsyncIterator[BaseModel]:
    """Chunks for one streamed request (without `[DONE]`); each carries the log-probs of the tokens it covers."""
    rid = response_id(prepared)
    if prepared.kind == "chat":
        yield _chunk(prepared, rid, "", None, role=True)
    streamed_ids: list[int] = []
    async for piece in pieces:
        if piece.text or piece.finish_reason:
            logprobs = _logprobs(prepared, tokenizer, piece.tokens, streamed_ids)
            streamed_ids += [int(e.token_id) for e in piece.tokens if e.token_id is not None]
            yield _chunk(prepared, rid, piece.text, piece.finish_reason, logprobs=logprobs)
    if prepared.include_usage:
        usage = usage_of(prepared, result)
        if prepared.kind == "chat":
            yield ChatCompletionStreamResponse(id=rid, model=prepared.model, choices=[], usage=usage)
        else:
            yield CompletionStreamResponse(id=rid, model=prepared.model, choices=[], usage=usage)


__all__ = ["final_response", "stream_chunks", "usage_of", "response_id", "new_id"]
