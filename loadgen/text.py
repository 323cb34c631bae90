"""Synthetic prompt text with a known word count: one word of the vocabulary is meant to be ~one token.

Words are short lowercase syllable pairs with a leading space, the shape BPE tokenizers keep as one token.
`block_text(hash_id)` is a pure function of the id, so two trace requests sharing a hash id share text.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be")
VOCAB: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)  # 256 words


FAST_WORDS = 1024
"""From this many words on, `words` draws them through numpy's MT19937 (same generator, same draws)."""
_VOCAB_BYTES = np.frombuffer("".join(w + " " for w in VOCAB).encode("ascii"), dtype=np.uint8).reshape(len(VOCAB), -1)
"""Row i: VOCAB[i] and a space (every word has four letters)."""


def words(rng: random.Random, num_tokens: int) -> str:
    """`num_tokens` vocabulary words drawn from `rng`, space separated: `rng.choice(VOCAB)` per word. Long texts
    are drawn by `_words_mt` (the same words and the same state of `rng` afterwards, at numpy speed)."""
    if num_tokens >= FAST_WORDS and type(rng) is random.Random:
        return _words_mt(rng, num_tokens)
    return naive_words(rng, num_tokens)


def naive_words(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(num_tokens))


def _words_mt(rng: random.Random, num_tokens: int) -> str:
    """`rng.choice` over 256 words takes `getrandbits(9)` (the top 9 bits of one 32-bit Mersenne Twister output)
    until it is below 256: replay that on numpy's MT19937 from `rng`'s state, then hand `rng` the state after
    exactly the outputs used."""
    version, internal, gauss_next = rng.getstate()
    start = {"bit_generator": "MT19937", "state": {"key": np.array(internal[:624], dtype=np.uint32),
                                                   "pos": internal[624]}}
    gen = np.random.MT19937()
    gen.state = start
    chunks, used, need = [], 0, num_tokens
    while need > 0:
        top = gen.random_raw(2 * need + 64) >> 23
        accepted = np.flatnonzero(top < len(VOCAB))
        if len(accepted) >= need:
            end = int(accepted[need - 1]) + 1
            chunks.append(top[accepted[:need]])
            used += end
            need = 0
        else:
            chunks.append(top[accepted])
            used += len(top)
            need -= len(accepted)
    gen.state = start
    gen.random_raw(used)
    after = gen.state["state"]
    rng.setstate((version, (*(int(k) for k in after["key"]), int(after["pos"])), gauss_next))
    return _VOCAB_BYTES[np.concatenate(chunks)].tobytes()[:-1].decode("ascii")


def seeded_words(key: str, num_tokens: int) -> str:
    """`num_tokens` words determined only by `key` (stable across processes and Python versions)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return words(random.Random(seed), num_tokens)


def block_text(hash_id: int, block_tokens: int) -> str:
    """The text of one trace block: the same hash id always gives the same words."""
    return seeded_words(f"block:{hash_id}", block_tokens)


def count_words(text: str) -> int:
    return len(text.split())
