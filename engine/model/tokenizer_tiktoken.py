"""Kimi-style `tiktoken.model` vocabularies through the `tiktoken` package.

The file holds one `<base64 bytes> <rank>` line per BPE token (ranks are the token ids 0..N-1). Kimi checkpoints
put the split pattern in their tokenizer code rather than in a file, so the pattern below is Kimi's published one
(Han runs; cased word pieces with English contractions; 1-3 digit numbers; punctuation runs; newlines; spaces).
Special tokens take the ids after the BPE ranks: those `tokenizer_config.json` lists in `added_tokens_decoder`
keep their ids and text, the rest of the `RESERVED_SPECIALS` slots are named `<|reserved_token_{id}|>`. Special
token text in a prompt encodes to the special id (as Kimi's tokenizer encodes by default); decoding skips specials.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from engine.model.tokenizer_files import TokenizerFileError, TokenizerFiles

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
"""The split pattern of Kimi's tiktoken tokenizers (fancy-regex syntax: `&&` intersects character classes)."""
RESERVED_SPECIALS = 256
"""Special-token slots after the BPE ranks (Kimi reserves 256)."""


def read_ranks(files: TokenizerFiles) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken.model file; a malformed line is an error naming its number."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(files.vocab_path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected `<base64> <rank>`")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise TokenizerFileError(f"{files.vocab_path}: line {number}: {exc}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFileError(f"{files.vocab_path}: ranks must be the ids 0..{len(ranks) - 1}, each once")
    return ranks


class TiktokenCodec:
    """A `tiktoken.Encoding` over the checkpoint's ranks, its specials and the Kimi pattern."""

    def __init__(self, files: TokenizerFiles) -> None:
        import tiktoken

        ranks = read_ranks(files)
        num_base = len(ranks)
        listed = {t.token_id: t.content for t in files.added_tokens}
        low = [token_id for token_id in listed if token_id < num_base]
        if low:
            raise TokenizerFileError(f"{files.directory / 'tokenizer_config.json'}: added_tokens_decoder id {low[0]} "
                                     f"is a BPE rank of {files.vocab_path.name} (specials start at {num_base})")
        last = max([num_base + RESERVED_SPECIALS - 1, *listed])
        self._specials = {token_id: listed.get(token_id, f"<|reserved_token_{token_id}|>")
                          for token_id in range(num_base, last + 1)}
        self._special_ids = {text: token_id for token_id, text in self._specials.items()}
        self._enc = tiktoken.Encoding(name=f"checkpoint:{files.directory.name}", pat_str=KIMI_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self._special_ids)
        self.special_ids = frozenset(self._specials)
        self.vocab_size = last + 1
        self._add_bos = bool(files.add_bos_token)
        self._add_eos = bool(files.add_eos_token)
        self._bos = self._special_ids.get(files.special("bos_token") or "")
        self._eos = self._special_ids.get(files.special("eos_token") or "")

    def token_to_id(self, text: str) -> int | None:
        if text in self._special_ids:
            return self._special_ids[text]
        try:
            return self._enc.encode_single_token(text.encode())
        except KeyError:
            return None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._enc.encode(text, allowed_special="all")
        if add_special_tokens and self._add_bos and self._bos is not None:
            ids = [self._bos, *ids]
        if add_special_tokens and self._add_eos and self._eos is not None:
            ids = [*ids, self._eos]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        kept = [token_id for token_id in ids if token_id not in self._specials and 0 <= token_id < self.vocab_size]
        return self._enc.decode_bytes(kept).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._specials:
            return self._specials[token_id].encode()
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return f"<|{token_id}|>".encode()
