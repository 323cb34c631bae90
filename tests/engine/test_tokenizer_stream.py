"""Incremental detokenisation (engine/model/tokenizer_stream.py): the streamed text equals the whole decode on
random and character-splitting sequences of every tokenizer kind (byte, byte-level BPE, tiktoken), and each
token decodes a bounded number of ids whatever the stream (runs of invalid bytes, of skipped specials, of split
characters), where a window that grows with the answer would make a long answer quadratic."""

from __future__ import annotations

import random

import pytest

from engine.model.tokenizer import ByteTokenizer, load_tokenizer
from engine.model.tokenizer_stream import CONTEXT_TOKENS, MAX_PENDING, IncrementalDecoder
from tests.checkpoint_tokenizer import save_bpe_tokenizer, save_tiktoken_tokenizer

MAX_IDS_PER_DECODE = 2 * (MAX_PENDING + 1) + CONTEXT_TOKENS
"""The most ids one decode call may see: the context group plus the held tokens."""


@pytest.fixture(scope="module", params=["byte", "bpe", "tiktoken"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer()
    save = save_bpe_tokenizer if request.param == "bpe" else save_tiktoken_tokenizer
    return load_tokenizer(save(tmp_path_factory.mktemp(request.param) / "t"))


class Counting:
    """The tokenizer's decode, counting the ids each call sees."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def __call__(self, ids) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(list(ids))


def _stream(tokenizer, ids, context=(), decode=None):
    decoder = IncrementalDecoder(decode or tokenizer.decode, list(context))
    return "".join(decoder.add(i) for i in ids) + decoder.flush()


def _partial(tokenizer) -> list[int]:
    """Ids whose bytes alone are not valid UTF-8 (pieces of characters, stray continuation bytes)."""
    out = []
    for token_id in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            out.append(token_id)
    return out


def _specials(tokenizer) -> list[int]:
    return [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == ""]


def _encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(text, False)


def test_random_sequences_stream_to_the_whole_decode(tokenizer) -> None:
    rng = random.Random(7)
    partial, specials = _partial(tokenizer), _specials(tokenizer)
    assert partial and specials, "the test needs split-character and skipped ids"
    pools = {"any": list(range(tokenizer.vocab_size)), "partial": partial, "mixed": partial + specials,
             "mostly-special": specials * 4 + partial}
    for name, pool in pools.items():
        for trial in range(30):
            ids = [rng.choice(pool) for _ in range(rng.randrange(1, 120))]
            context = [rng.choice(pools["any"]) for _ in range(rng.randrange(0, 6))]
            assert _stream(tokenizer, ids, context) == tokenizer.decode(ids), (name, trial, ids, context)


def test_characters_split_over_tokens_and_specials_stream_to_the_whole_decode(tokenizer) -> None:
    rng = random.Random(3)
    specials = _specials(tokenizer)
    text = "\u4f60\u597d \U0001f600\U0001f44d\U0001f3fd caf\u00e9 \u00e5ngstr\u00f6m \u2192 ok \u2211\u221e"
    ids = _encode(tokenizer, text)
    for _ in range(40):
        mixed = []
        for token_id in ids:  # specials between the pieces of a character: the decode skips them
            mixed += [rng.choice(specials) for _ in range(rng.choice([0, 0, 1, 3, 12]))] + [token_id]
        assert _stream(tokenizer, mixed) == tokenizer.decode(mixed) == text
    broken = [i for i in _encode(tokenizer, "\U0001f600" * 3)][:-1]  # ends mid-character: U+FFFD, as a whole
    assert _stream(tokenizer, broken) == tokenizer.decode(broken)


@pytest.mark.parametrize("kind", ["partial", "special", "mixed", "text"])
def test_each_token_decodes_a_bounded_number_of_ids(tokenizer, kind) -> None:
    rng = random.Random(11)
    partial, specials = _partial(tokenizer), _specials(tokenizer)
    pool = {"partial": partial, "special": specials, "mixed": partial + specials,
            "text": _encode(tokenizer, "caf\u00e9 \u4f60\u597d \U0001f600 ")}[kind]
    ids = [rng.choice(pool) for _ in range(3000)]
    counting = Counting(tokenizer)
    assert _stream(tokenizer, ids, _encode(tokenizer, "Hello"), counting) == tokenizer.decode(ids)
    assert max(counting.sizes) <= MAX_IDS_PER_DECODE, f"a decode saw {max(counting.sizes)} ids"
    assert len(counting.sizes) <= 6 * len(ids)
