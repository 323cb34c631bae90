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
from node.logprobs import (
    Detokenizer,
    chat_logprobs,
    completion_logprobs,
    vllm_prompt_logprobs,
)
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
    """A resumed request counts the tokens its earlier stream sent as completion tokens, as that stream would, and
    no more cached tokens than its prompt has (a cache may also have held some of the resumed tokens)."""
    num_resumed = prepared.num_resumed
    num_prompt = len(prepared.prompt_token_ids) - num_resumed
    return UsageInfo.of(num_prompt, num_resumed + len(result.tokens), min(result.num_cached_tokens, num_prompt))


def _logprobs(prepared: PreparedRequest, tokenizer: Detokenizer, events: Sequence[TokenEvent],
              prefix_ids: Sequence[int] = ()) -> Any:
    """The choice's (or chunk's) log-probs in the endpoint's format, or None when the request asked for none."""
    if prepared.sampling.logprobs is None:
        return None
    if prepared.kind == "chat":
        return chat_logprobs(tokenizer, events)
    return completion_logprobs(tokenizer, events, prefix_ids)


def _prompt_logprobs(prepared: PreparedRequest, tokenizer: Detokenizer, result: GenerationResult) -> Any:
    return vllm_prompt_logprobs(tokenizer, result.prompt_tokens) if prepared.prompt_logprobs else None


def final_response(prepared: PreparedRequest, result: GenerationResult, tokenizer: Detokenizer,
                   kv_transfer_params: dict[str, Any] | None = None) -> BaseModel:
    """The non-streaming body. Completions with `echo` start with the prompt's text (and its tokens' log-probs;
    the first prompt token has none)."""
    usage = usage_of(prepared, result)
    prompt_logprobs = _prompt_logprobs(prepared, tokenizer, result)
    if prepared.kind == "chat":
        choice = ChatCompletionChoice(message=ChatMessageOut(content=result.text), finish_reason=result.finish_reason,
                                      logprobs=_logprobs(prepared, tokenizer, result.tokens),
                                      prompt_logprobs=prompt_logprobs)
        return ChatCompletionResponse(id=response_id(prepared), model=prepared.model, choices=[choice],
                                      usage=usage, kv_transfer_params=kv_transfer_params)
    text, events, token_ids = result.text, list(result.tokens), result.token_ids
    if prepared.echo:
        text = tokenizer.decode(prepared.prompt_token_ids) + text
        events = result.prompt_tokens + events  # an echo always asks the engine for the prompt's events
        token_ids = list(prepared.prompt_token_ids) + token_ids
    choice = CompletionChoice(text=text, logprobs=_logprobs(prepared, tokenizer, events),
                              finish_reason=result.finish_reason, token_ids=token_ids,
                              prompt_logprobs=prompt_logprobs)
    return CompletionResponse(id=response_id(prepared), model=prepared.model, choices=[choice], usage=usage,
                              kv_transfer_params=kv_transfer_params)


def _chunk(prepared: PreparedRequest, rid: str, text: str | None, finish: str | None,
           role: bool = False, logprobs: Any = None, prompt_logprobs: Any = None,
           token_ids: list[int] | None = None) -> BaseModel:
    if prepared.kind == "chat":
        delta = DeltaMessage(role="assistant" if role else None, content=text)
        choice = ChatStreamChoice(delta=delta, logprobs=logprobs, finish_reason=finish, prompt_logprobs=prompt_logprobs,
                                  token_ids=token_ids)
        return ChatCompletionStreamResponse(id=rid, model=prepared.model, choices=[choice])
    choice = CompletionStreamChoice(text=text or "", logprobs=logprobs, finish_reason=finish,
                                    prompt_logprobs=prompt_logprobs, token_ids=token_ids)
    return CompletionStreamResponse(id=rid, model=prepared.model, choices=[choice])


def _prompt_chunk(prepared: PreparedRequest, rid: str, piece: Piece, tokenizer: Detokenizer) -> BaseModel | None:
    """The chunk for the prompt piece: the echoed prompt with its tokens' log-probs (completions with `echo`)
    and vLLM's `prompt_logprobs` when asked; None when the client asked for neither."""
    vllm_list = vllm_prompt_logprobs(tokenizer, piece.tokens) if prepared.prompt_logprobs else None
    echoed = prepared.echo and prepared.kind == "completion"
    if not echoed and vllm_list is None:
        return None
    logprobs = _logprobs(prepared, tokenizer, piece.tokens) if echoed else None
    return _chunk(prepared, rid, piece.text if echoed else "", None, logprobs=logprobs, prompt_logprobs=vllm_list)


async def stream_chunks(prepared: PreparedRequest, pieces: AsyncIterator[Piece], result: GenerationResult,
                        tokenizer: Detokenizer) -> AsyncIterator[BaseModel]:
    """Chunks for one streamed request (without `[DONE]`); each carries the log-probs of the tokens it covers.
    The prompt's chunk (echo, prompt log-probs) comes first; offsets of later tokens continue after it. A resumed
    request continues its earlier stream: no role chunk, offsets after the resumed tokens."""
    rid = response_id(prepared)
    if prepared.kind == "chat" and not prepared.num_resumed:
        yield _chunk(prepared, rid, "", None, role=True)
    streamed_ids: list[int] = list(prepared.resumed_ids)
    async for piece in pieces:
        if piece.is_prompt:
            chunk = _prompt_chunk(prepared, rid, piece, tokenizer)
            if chunk is not None:
                yield chunk
            if prepared.echo:
                streamed_ids += list(prepared.prompt_token_ids)
            continue
        if piece.text or piece.finish_reason or piece.is_flush:
            logprobs = _logprobs(prepared, tokenizer, piece.tokens, streamed_ids)
            ids = [int(e.token_id) for e in piece.tokens if e.token_id is not None]
            streamed_ids += ids
            yield _chunk(prepared, rid, piece.text, piece.finish_reason, logprobs=logprobs,
                         token_ids=ids if prepared.return_token_ids else None)
    if prepared.include_usage:
        usage = usage_of(prepared, result)
        if prepared.kind == "chat":
            yield ChatCompletionStreamResponse(id=rid, model=prepared.model, choices=[], usage=usage)
        else:
            yield CompletionStreamResponse(id=rid, model=prepared.model, choices=[], usage=usage)


__all__ = ["final_response", "stream_chunks", "usage_of", "response_id", "new_id"]
