"""Incremental detokenisation: token ids in one at a time, text out, never half a character.

Decoding a growing id list again at every token is quadratic, and decoding each token alone is wrong for
tokenizers whose text depends on the neighbours (a SentencePiece word start's space, a multi-byte character split
over byte-level tokens). `IncrementalDecoder` decodes a short window instead: the text of `ids[prefix:]` less the
text of `ids[prefix:read]` (the tokens emitted last, as left context) is what the new tokens add. While that
addition ends in U+FFFD (an incomplete UTF-8 sequence: the next token may complete it) nothing is emitted and the
window grows; once it is clean, it is emitted and the window moves on. `flush()` emits what is still held (an
answer that really ends in a broken sequence ends in U+FFFD, as a whole decode would).

The window may start with context (the prompt's last tokens), so the first generated token decodes as it would
after the prompt: the context's own text is never emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4
"""Prompt tokens decoded as left context before the first generated token."""


class IncrementalDecoder:
    """One sequence's detokeniser; `decode(ids)` is the tokenizer's decode (special tokens skipped)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        context = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        if context and REPLACEMENT in decode(context):  # a context cut mid-character would shift the window's text
            context = []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def add(self, token_id: int) -> str:
        """The text that became final with this token ('' while a character is incomplete)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete sequence at the end decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]
