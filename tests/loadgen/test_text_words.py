"""Synthetic text at numpy speed, draw for draw what `random.Random` gives: `StreamRandom` (loadgen/mt.py) and
`words` (loadgen/text.py) against the plain generator's per-word `choice`, with the same state after."""

from __future__ import annotations

import random

import pytest

from loadgen.lengths import parse_dist
from loadgen.mt import N, StreamRandom
from loadgen.text import FAST_WORDS, VOCAB, naive_words, words


@pytest.mark.parametrize("num", [FAST_WORDS, FAST_WORDS + 1, 3 * FAST_WORDS + 7, 20_000])
@pytest.mark.parametrize("seed", [0, 1, "agentx:3", 2**40])
def test_words_equal_the_per_word_draws_and_leave_the_same_state(num: int, seed) -> None:
    a, b = random.Random(seed), random.Random(seed)
    a.gauss(0.0, 1.0), b.gauss(0.0, 1.0)  # a pending gauss value survives too
    assert words(a, num) == naive_words(b, num)
    assert a.getstate() == b.getstate()
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]


def _mixed_draws(rng: random.Random, text) -> list:  # noqa: ANN001 - words or naive_words
    """What the scenarios draw, interleaved: lengths, turns, think times, probabilities, texts of every size."""
    out: list = [rng.getrandbits(0), rng.getrandbits(33), rng.getrandbits(64), rng.getrandbits(95)]
    for k in range(60):
        n = parse_dist("lognormal:300,1.2").sample_int(rng, minimum=0)
        out += [n, rng.random(), rng.uniform(1, 5), rng.expovariate(2.0), rng.gauss(0, 1), rng.randint(4, 12),
                text(rng, n if k % 7 else 0), text(rng, k % 3), rng.choice(VOCAB)]
        if k == 30:
            rng.setstate(rng.getstate())
    return out


@pytest.mark.parametrize("seed", [0, 7, "0:session:12", 2**70])
def test_stream_random_draws_what_random_draws(seed) -> None:
    fast, plain = StreamRandom(seed), random.Random(seed)
    assert fast.getstate() == plain.getstate()
    assert _mixed_draws(fast, words) == _mixed_draws(plain, naive_words)
    assert fast.getstate() == plain.getstate()
    assert [fast.getrandbits(32) for _ in range(3 * N)] == [plain.getrandbits(32) for _ in range(3 * N)]


@pytest.mark.parametrize("offset", [0, 1, N - 1, N, N + 5, 5 * N - 3])
def test_stream_random_from_any_state_position(offset: int) -> None:
    """A state taken mid-block (or at a block's end) continues as the plain generator does, bulk draws included."""
    plain = random.Random("pos")
    for _ in range(offset):
        plain.getrandbits(32)
    fast = StreamRandom.from_state(plain.getstate())
    for num in (1, 2 * N, 7 * N + 11, 3):
        assert words(fast, num) == naive_words(plain, num)
        assert fast.getstate() == plain.getstate()


def test_draw_words_refuses_another_vocabulary() -> None:
    with pytest.raises(ValueError, match="256 words"):
        StreamRandom(0).draw_words(4, 100)
