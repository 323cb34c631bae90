"""`words` draws long texts through numpy's Mersenne Twister: the same words and the same generator state after."""

from __future__ import annotations

import random

import pytest

from loadgen.text import FAST_WORDS, naive_words, words


@pytest.mark.parametrize("num", [FAST_WORDS, FAST_WORDS + 1, 3 * FAST_WORDS + 7, 20_000])
@pytest.mark.parametrize("seed", [0, 1, "agentx:3", 2**40])
def test_words_equal_the_per_word_draws_and_leave_the_same_state(num: int, seed) -> None:
    a, b = random.Random(seed), random.Random(seed)
    a.gauss(0.0, 1.0), b.gauss(0.0, 1.0)  # a pending gauss value survives too
    assert words(a, num) == naive_words(b, num)
    assert a.getstate() == b.getstate()
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
