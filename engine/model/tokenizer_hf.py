"""The `tokenizer.json` vocabulary through the `tokenizers` package: encode, decode and each token's bytes.

Prompts are encoded with the file's own post-processor (a BOS where the checkpoint's `tokenizer.json` adds one);
chat text rendered by the template is encoded without it (the template writes its specials). Named special tokens
of tokenizer_config.json missing from the vocabulary are added as special tokens, as transformers adds them.
A token's bytes (log-prob token names): byte-level BPE tokens map back through the GPT-2 byte alphabet, byte
fallback tokens (`<0x41>`) are their byte, SentencePiece-style tokens have `▁` as the space, added tokens are their
text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache

from engine.model.tokenizer_files import TokenizerFileError, TokenizerFiles

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, DEL, NBSP, soft hyphen) take code points 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _kinds(component: dict | None) -> set[str]:
    """Every `type` named in a tokenizer.json component, nested Sequences included."""
    if not isinstance(component, dict):
        return set()
    found = {component.get("type", "")}
    for key in ("decoders", "pretokenizers", "normalizers", "processors"):
        for child in component.get(key) or ():
            found |= _kinds(child)
    return found


class TokenizersCodec:
    """A `tokenizers.Tokenizer` loaded from the checkpoint's tokenizer.json."""

    def __init__(self, files: TokenizerFiles) -> None:
        from tokenizers import AddedToken, Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(files.vocab_path))
        except Exception as exc:  # the Rust side raises a bare Exception for a malformed file
            raise TokenizerFileError(f"{files.vocab_path}: not a tokenizers file ({exc})") from None
        missing = [text for _, text in files.named_specials if self._tok.token_to_id(text) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in missing])
        raw = json.loads(files.vocab_path.read_text(encoding="utf-8"))
        decoder_kinds = _kinds(raw.get("decoder"))
        self._byte_level = "ByteLevel" in decoder_kinds
        self._spiece = bool(decoder_kinds & {"Metaspace", "Replace"})
        added = self._tok.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self.special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return f"<|{token_id}|>".encode()
        if self._byte_level:
            table = byte_alphabet()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        byte = _BYTE_FALLBACK.match(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return (piece.replace(SPIECE_SPACE, " ") if self._spiece else piece).encode()
