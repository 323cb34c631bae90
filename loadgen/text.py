"""Synthetic prompt text with a known word count: one word of the vocabulary is meant to be ~one token.

Words are short lowercase syllable pairs with a leading space, the shape BPE tokenizers keep as one token.
`block_text(hash_id)` is a pure function of the id, so two trace requests sharing a hash id share text.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from loadgen.mt import StreamRandom

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be")
VOCAB: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)  # 256 words


FAST_WORDS = 512
"""From this many words on, `words` replays a plain `random.Random` in numpy (same draws, same state after)."""
_VOCAB_BYTES = np.frombuffer("".join(w + " " for w in VOCAB).encode("ascii"), dtype=np.uint8).view("V5")
"""Item i: VOCAB[i] and a space as one 5-byte item (every word has four letters)."""


def words(rng: random.Random, num_tokens: int) -> str:
    """`num_tokens` vocabulary words drawn from `rng`, space separated: `rng.choice(VOCAB)` per word. A
    `StreamRandom` (loadgen/mt.py) draws them in one numpy pass; a plain `random.Random` does for long texts
    (through a `StreamRandom` on its state, which it gets back after), word by word for short ones."""
    if type(rng) is StreamRandom:
        return _text(rng.draw_words(num_tokens, len(VOCAB)))
    if num_tokens >= FAST_WORDS and type(rng) is random.Random:
        stream = StreamRandom.from_state(rng.getstate())
        text = _text(stream.draw_words(num_tokens, len(VOCAB)))
        rng.setstate(stream.getstate())
        return text
    return naive_words(rng, num_tokens)


def naive_words(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(num_tokens))


def _text(indices: np.ndarray) -> str:
    if not len(indices):
        return ""
    return _VOCAB_BYTES.take(indices).tobytes()[:-1].decode("ascii")


def seeded_words(key: str, num_tokens: int) -> str:
    """`num_tokens` words determined only by `key` (stable across processes and Python versions)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return words(random.Random(seed), num_tokens)


def block_text(hash_id: int, block_tokens: int) -> str:
    """The text of one trace block: the same hash id always gives the same words."""
    return seeded_words(f"block:{hash_id}", block_tokens)


def count_words(text: str) -> int:
    return len(text.split())
