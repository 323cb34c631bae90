"""`StreamRandom`: a `random.Random` that draws the same numbers as CPython's, its Mersenne Twister run in numpy.

CPython's generator is MT19937: 624 state words, twisted 624 at a time, each output word tempered. Every method of
`random.Random` (`random`, `choice`, `gauss`, `uniform`, `expovariate`, ...) reduces to two primitives, `random()`
(two outputs: 27 + 26 bits) and `getrandbits(k)`; this class implements those two on blocks of 624 tempered
outputs from numpy's MT19937 bit generator (the same algorithm on the same state words), so the inherited methods return exactly what `random.Random` returns for the same seed,
and `getstate()` is the state `random.Random` would have. What it adds is `draw_words(n, vocab_size)`: n uniform
choices from a 256-word vocabulary (`rng.choice(vocab)` n times) as one vectorised pass over the outputs, which is
what loadgen's synthetic text spends its time on (loadgen/text.py). tests/loadgen/test_text_words.py compares it
with `random.Random` draw by draw.
"""

from __future__ import annotations

import random

import numpy as np

N = 624
"""State words of MT19937: one twist makes N outputs."""
FETCH_BLOCKS = 16
"""Blocks fetched at least per refill (a text of n words takes about 2n outputs)."""


def untemper(y: np.ndarray) -> np.ndarray:
    """The state words whose tempered outputs are `y` (MT19937's tempering inverted, step by step)."""
    y = y ^ (y >> np.uint32(18))
    y = y ^ ((y << np.uint32(15)) & np.uint32(0xEFC60000))
    x = y
    for _ in range(4):  # y ^= (y << 7) & mask: seven more correct low bits per round
        x = y ^ ((x << np.uint32(7)) & np.uint32(0x9D2C5680))
    y = x
    x = y
    for _ in range(2):  # y ^= y >> 11
        x = y ^ (x >> np.uint32(11))
    return x


class StreamRandom(random.Random):
    """`random.Random` with the same outputs, from numpy blocks (see the module docstring).

    `_buf` holds whole blocks of outputs (each block: the tempered state words after one twist) and `_pos` the
    index of the next output; numpy's generator `_bits` stands at the end of `_buf`. A block's state words are its
    untempered outputs, so `getstate()` is the block holding the last output drawn, untempered, with the position
    in it. A refill keeps the last block of the old buffer in front of the new ones."""

    def seed(self, a: object = None, version: int = 2) -> None:
        super().seed(a, version)
        self._load(super().getstate()[1])

    def _load(self, internal: tuple[int, ...]) -> None:
        if not hasattr(self, "_bits"):
            self._bits = np.random.MT19937(0)
        key = np.array(internal[:N], dtype=np.uint32)
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 0}}
        self._buf = self._bits.random_raw(N).astype(np.uint32)  # the current block, whole
        self._pos = internal[N]

    def getstate(self) -> tuple:
        block = max(0, -(-self._pos // N) - 1)
        key = untemper(self._buf[block * N:(block + 1) * N])
        return self.VERSION, (*key.tolist(), self._pos - block * N), self.gauss_next

    def setstate(self, state: tuple) -> None:
        super().setstate(state)  # validates it
        self._load(state[1])

    @classmethod
    def from_state(cls, state: tuple) -> StreamRandom:
        rng = cls()
        rng.setstate(state)
        return rng

    def _refill(self, need: int) -> None:
        """More blocks after the buffer (used up), enough for about `need` words."""
        num_blocks = max(FETCH_BLOCKS, -(-(2 * need + 64) // N))
        fresh = self._bits.random_raw(num_blocks * N).astype(np.uint32)
        self._buf = np.concatenate((self._buf[-N:], fresh))
        self._pos = N

    def _next32(self) -> int:
        if self._pos >= len(self._buf):
            self._refill(0)
        value = int(self._buf[self._pos])
        self._pos += 1
        return value

    def random(self) -> float:
        a, b = self._next32() >> 5, self._next32() >> 6
        return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        if k <= 32:
            return self._next32() >> (32 - k) if k else 0
        value, shift = 0, 0
        while k > 0:  # little-endian 32-bit words, the last one cut to its top bits
            word = self._next32()
            if k < 32:
                word >>= 32 - k
            value |= word << shift
            shift += 32
            k -= 32
        return value

    def draw_words(self, n: int, vocab_size: int) -> np.ndarray:
        """Indices of `n` draws of `choice` over `vocab_size` == 256 words, as `choice` draws them:
        `getrandbits(9)` (an output's top 9 bits) until one is below 256."""
        if vocab_size != 256:
            raise ValueError(f"draw_words draws from 256 words, got a vocabulary of {vocab_size}")
        picked, need = [], n
        while need > 0:
            if self._pos >= len(self._buf):
                self._refill(need)
            span = 2 * need + 4 * int(need ** 0.5) + 64  # half the outputs are accepted: enough, mostly
            top = self._buf[self._pos:self._pos + span] >> np.uint32(23)
            accepted = np.flatnonzero(top < vocab_size)
            if len(accepted) >= need:
                picked.append(top[accepted[:need]])
                self._pos += int(accepted[need - 1]) + 1
                break
            picked.append(top[accepted])
            need -= len(accepted)
            self._pos += len(top)
        if len(picked) == 1:
            return picked[0]
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.uint32)
