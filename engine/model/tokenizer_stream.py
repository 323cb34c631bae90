"""Incremental detokenisation: token ids in one at a time, text out, never half a character, bounded work per token.

Decoding a growing id list again at every token is quadratic, and decoding each token alone is wrong for
tokenizers whose text depends on the neighbours (a SentencePiece word start's space, a multi-byte character split
over byte-level tokens). `IncrementalDecoder` decodes a short window instead: the text of `ids[prefix:]` less the
text of `ids[prefix:read]` (the tokens emitted last, as left context) is what the new tokens add. While that
addition ends in U+FFFD (an incomplete UTF-8 sequence: the next token may complete it) nothing is emitted and the
window grows; once it is clean, it is emitted and the window moves on. `flush()` emits what is still held (an
answer that really ends in a broken sequence ends in U+FFFD, as a whole decode would).

The window stays short whatever the tokens, so each token costs a bounded decode:
- a token that has no text alone and adds none to the window (a special the decode skips) is dropped from it: it
  never changes the text of its neighbours either (a byte continuing an incomplete character adds no text to the
  window either, but has a text alone, U+FFFD);
- while more than `MAX_PENDING` tokens are held (a run of invalid bytes: every addition ends in U+FFFD), the text of
  the window less its last `KEEP_PENDING` tokens is emitted when it is a prefix of the whole window's text: an
  incomplete UTF-8 sequence spans at most 3 bytes (so at most 3 tokens, each adding at least a byte), and one
  the later tokens completed into another character would not be such a prefix.
The concatenated output equals the tokenizer's decode of all ids (tests/engine/test_tokenizer_stream.py compares
them on random and character-splitting sequences, and counts the ids each token decodes).

The window may start with context (the prompt's last tokens), so the first generated token decodes as it would
after the prompt: the context's own text is never emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4
"""Prompt tokens decoded as left context before the first generated token."""
MAX_PENDING = 8
"""Held tokens past which the decoder emits all but the last `KEEP_PENDING` of them when it safely can."""
KEEP_PENDING = 4
"""Tokens kept back by such a cut: more than an incomplete UTF-8 sequence can span."""


class IncrementalDecoder:
    """One sequence's detokeniser; `decode(ids)` is the tokenizer's decode (special tokens skipped)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        context = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        before = decode(context) if context else ""
        if REPLACEMENT in before:  # a context cut mid-character would shift the window's text
            context, before = [], ""
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._before = before
        """The text of ids[prefix:read]."""
        self._window = before
        """The text of ids[prefix:] (the whole window)."""

    def add(self, token_id: int) -> str:
        """The text that became final with this token ('' while a character is incomplete)."""
        self._ids.append(token_id)
        after = self._decode(self._ids[self._prefix:])
        if after == self._window and self._decode([token_id]) == "":  # a skipped special: keep the window short
            self._ids.pop()
            return ""
        self._window = after
        if len(after) > len(self._before) and not after.endswith(REPLACEMENT):
            return self._move(len(self._ids), after)
        if len(self._ids) - self._read > MAX_PENDING:
            return self._cut()
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete sequence at the end decodes to U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._move(len(self._ids), self._window)

    def _move(self, end: int, text: str) -> str:
        """Emit `text` (the text of ids[prefix:end]) past what was emitted; ids[read:end] become the context."""
        delta = text[len(self._before):]
        del self._ids[:self._read]  # what lies before the new context is never decoded again
        self._prefix, self._read = 0, end - self._read
        self._before = self._decode(self._ids[:self._read])
        self._window = self._decode(self._ids) if self._read < len(self._ids) else self._before
        return delta

    def _cut(self) -> str:
        end = len(self._ids) - KEEP_PENDING
        text = self._decode(self._ids[self._prefix:end])
        if len(text) <= len(self._before) or not self._window.startswith(text):
            return ""
        return self._move(end, text)
