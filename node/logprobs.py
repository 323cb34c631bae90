"""Log-probs in OpenAI's two response formats, from the engine's token events.

- Completions (`logprobs: k`): `tokens`, `token_logprobs`, `top_logprobs` (a dict token -> log-prob per position,
  k entries), `text_offset` (character offset of each token's text in the choice's text).
- Chat (`logprobs: true, top_logprobs: k`): `content`, a list of {token, logprob, bytes, top_logprobs}.
A token's string is its UTF-8 text when its bytes are valid UTF-8 on their own, else `bytes:\\xNN...` (a byte
of a multi-byte character), so every token has a distinct, lossless name; `bytes` carries the raw bytes.
Streamed chunks carry the entries of the tokens they cover; offsets continue across chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from engine.outputs import TokenEvent
from serving.protocol import ChatChoiceLogprobs, ChatLogprob, CompletionLogprobs


class TokenNames(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


def token_name(tokenizer: TokenNames, token_id: int) -> str:
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(value: float) -> float | None:
    """JSON has no NaN: a log-prob that is not known is null."""
    return None if math.isnan(value) else value


class Detokenizer(TokenNames, Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


def _text_length(tokenizer: Detokenizer, ids: Sequence[int]) -> int:
    """Characters of the text `ids` decode to, not counting a trailing incomplete UTF-8 sequence."""
    return len(tokenizer.decode(ids).rstrip("\ufffd"))


def completion_logprobs(tokenizer: Detokenizer, events: Sequence[TokenEvent], prefix_ids: Sequence[int] = ()
                        ) -> CompletionLogprobs:
    """Completions-format log-probs for `events`. `prefix_ids`: the tokens of the choice's text before these
    events (earlier chunks of a stream, or the echoed prompt), so text offsets count from the text's start."""
    out = CompletionLogprobs()
    ids = list(prefix_ids)
    for event in events:
        if event.token_id is None:
            continue
        out.text_offset.append(_text_length(tokenizer, ids))
        ids.append(event.token_id)
        out.tokens.append(token_name(tokenizer, event.token_id))
        out.token_logprobs.append(_finite(event.logprob))
        if math.isnan(event.logprob) and not event.top_logprobs:  # the first prompt token has none
            out.top_logprobs.append(None)
            continue
        top = {token_name(tokenizer, i): lp for i, lp in event.top_logprobs}
        top.setdefault(out.tokens[-1], out.token_logprobs[-1])  # type: ignore[arg-type]
        out.top_logprobs.append(top)
    return out


def vllm_prompt_logprobs(tokenizer: Detokenizer, events: Sequence[TokenEvent]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the most likely alternatives."""
    out: list[dict[str, Any] | None] = []
    for event in events:
        if event.token_id is None or (math.isnan(event.logprob) and not event.top_logprobs):
            out.append(None)
            continue
        entry: dict[str, Any] = {}
        values = [lp for _, lp in event.top_logprobs]
        for i, (token_id, lp) in enumerate(event.top_logprobs):
            rank = values.index(lp) + 1  # 1 + how many alternatives are strictly more likely (sorted list)
            entry[str(token_id)] = {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([token_id])}
        entry[str(event.token_id)] = {"logprob": _finite(event.logprob), "rank": event.rank or None,
                                      "decoded_token": tokenizer.decode([event.token_id])}
        out.append(entry)
    return out


def chat_logprobs(tokenizer: TokenNames, events: Sequence[TokenEvent]) -> ChatChoiceLogprobs:
    content = []
    for event in events:
        if event.token_id is None:
            continue
        tops = [{"token": token_name(tokenizer, i), "logprob": lp, "bytes": list(tokenizer.token_bytes(i))}
                for i, lp in event.top_logprobs]
        content.append(ChatLogprob(token=token_name(tokenizer, event.token_id), logprob=_finite(event.logprob),
                                   bytes=list(tokenizer.token_bytes(event.token_id)), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)
