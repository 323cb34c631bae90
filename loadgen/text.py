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


FAST_WORDS = 512
"""From this many words on, `words` replays the generator in numpy (same draws, same state after)."""
_VOCAB_BYTES = np.frombuffer("".join(w + " " for w in VOCAB).encode("ascii"), dtype=np.uint8).reshape(len(VOCAB), -1)
"""Row i: VOCAB[i] and a space (every word has four letters)."""
_N, _M = 624, 397
_UPPER, _LOWER, _MATRIX = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF)


def words(rng: random.Random, num_tokens: int) -> str:
    """`num_tokens` vocabulary words drawn from `rng`, space separated: `rng.choice(VOCAB)` per word. Long texts
    are drawn by `_words_mt` (the same words and the same state of `rng` afterwards, at numpy speed)."""
    if num_tokens >= FAST_WORDS and type(rng) is random.Random:
        return _words_mt(rng, num_tokens)
    return naive_words(rng, num_tokens)


def naive_words(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(num_tokens))


def _twist(mt: np.ndarray) -> np.ndarray:
    """The Mersenne Twister's next 624 state words (MT19937's generate step, in the four slices its recurrence
    allows: word i reads words i+1 (old) and i+397 (old below 227, already new above))."""
    new = mt.copy()

    def part(lo: int, hi: int) -> None:
        y = (new[lo:hi] & _UPPER) | (mt[lo + 1:hi + 1] & _LOWER)
        new[lo:hi] = new[(lo + _M) % _N:(hi + _M - 1) % _N + 1] ^ (y >> 1) ^ ((y & 1) * _MATRIX)

    part(0, 227)
    part(227, 454)
    part(454, 623)
    y = (new[623] & _UPPER) | (new[0] & _LOWER)
    new[623] = new[396] ^ (y >> 1) ^ ((y & 1) * _MATRIX)
    return new


def _temper(y: np.ndarray) -> np.ndarray:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & np.uint32(0x9D2C5680))
    y = y ^ ((y << 15) & np.uint32(0xEFC60000))
    return y ^ (y >> 18)


def _words_mt(rng: random.Random, num_tokens: int) -> str:
    """`rng.choice` over 256 words takes `getrandbits(9)` (the top 9 bits of one 32-bit Mersenne Twister output)
    until it is below 256: replay that on `rng`'s own state words in numpy, then hand `rng` the state after
    exactly the outputs used."""
    version, internal, gauss_next = rng.getstate()
    mt, pos = np.array(internal[:_N], dtype=np.uint32), internal[_N]
    picked, need = [], num_tokens
    while need:
        if pos >= _N:
            mt, pos = _twist(mt), 0
        top = _temper(mt[pos:]) >> 23
        accepted = np.flatnonzero(top < len(VOCAB))
        if len(accepted) >= need:
            picked.append(top[accepted[:need]])
            pos += int(accepted[need - 1]) + 1
            need = 0
        else:
            picked.append(top[accepted])
            need -= len(accepted)
            pos = _N
    rng.setstate((version, (*mt.tolist(), pos), gauss_next))
    return _VOCAB_BYTES[np.concatenate(picked)].tobytes()[:-1].decode("ascii")


def seeded_words(key: str, num_tokens: int) -> str:
    """`num_tokens` words determined only by `key` (stable across processes and Python versions)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return words(random.Random(seed), num_tokens)


def block_text(hash_id: int, block_tokens: int) -> str:
    """The text of one trace block: the same hash id always gives the same words."""
    return seeded_words(f"block:{hash_id}", block_tokens)


def count_words(text: str) -> int:
    return len(text.split())
