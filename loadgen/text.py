"""Synthetic prompt text with a known word count: one word of the vocabulary is meant to be ~one token.

Words are short lowercase syllable pairs with a leading space, the shape BPE tokenizers keep as one token.
`block_text(hash_id)` is a pure function of the id, so two trace requests sharing a hash id share text.
"""

from __future__ import annotations

import hashlib
import random

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be")
VOCAB: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)  # 256 words


def words(rng: random.Random, num_tokens: int) -> str:
    """`num_tokens` vocabulary words drawn from `rng`, space separated."""
    return " ".join(rng.choice(VOCAB) for _ in range(num_tokens))


def seeded_words(key: str, num_tokens: int) -> str:
    """`num_tokens` words determined only by `key` (stable across processes and Python versions)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return words(random.Random(seed), num_tokens)


def block_text(hash_id: int, block_tokens: int) -> str:
    """The text of one trace block: the same hash id always gives the same words."""
    return seeded_words(f"block:{hash_id}", block_tokens)


def count_words(text: str) -> int:
    return len(text.split())
