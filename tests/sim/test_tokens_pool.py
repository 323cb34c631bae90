"""Run-length prompts key blocks exactly as their tokens do; the timeless pool is RowPool minus the bytes."""

from __future__ import annotations

import random

from engine.cache import RowPool
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.prefix_cache import chain_keys
from loadgen.schedule import Message
from router.placement import estimate_prompt_tokens_bytes
from sim.pool import TimelessRowPool
from sim.tokens import Interner, Template, TokenRuns


def _random_runs(rng: random.Random) -> list[tuple[int, int, int]]:
    return [(rng.randrange(3), rng.randrange(5), rng.randrange(1, 6)) for _ in range(rng.randrange(1, 6))]


def test_equal_keys_exactly_when_equal_tokens() -> None:
    rng = random.Random(0)
    for _ in range(400):
        a, b = TokenRuns(_random_runs(rng)), TokenRuns(_random_runs(rng))
        for block in (1, 2, 4):
            n = min(len(a), len(b)) // block
            same_tokens = [list(a)[k * block:(k + 1) * block] == list(b)[k * block:(k + 1) * block] for k in range(n)]
            same_keys = [x == y for x, y in zip(chain_keys(a, block, n, b"f"), chain_keys(b, block, n, b"f"))]
            expected = [all(same_tokens[:k + 1]) for k in range(n)]  # chained: a key names the whole prefix
            assert same_keys == expected


def test_slices_concatenation_and_items_agree_with_lists() -> None:
    rng = random.Random(1)
    for _ in range(200):
        runs = TokenRuns(_random_runs(rng))
        tokens = list(runs)
        lo, hi = sorted(rng.randrange(len(tokens) + 1) for _ in range(2))
        assert list(runs[lo:hi]) == tokens[lo:hi]
        assert list(runs[lo:hi] + runs[:lo]) == tokens[lo:hi] + tokens[:lo]
        if tokens:
            i = rng.randrange(len(tokens))
            assert runs[i] == tokens[i]
        assert list(runs.extended(7, 3)) == tokens + list(runs.extended(7, 3))[len(tokens):]
        n = len(tokens)
        bounds = (None, 0, lo, hi, n, n + 3, -1, -lo - 1)
        for a in bounds:  # every form of a step-1 slice: open ends, past the end, negative, reversed
            for b in bounds:
                assert list(runs[a:b]) == tokens[a:b], (a, b)


def test_startswith_is_the_slice_comparison() -> None:
    """`TokenRuns.startswith` (engine/prefix_cache.py `add_tail` asks it) answers as slicing and comparing does: on
    random sequences, on their own prefixes (cut inside a run and at a run's end) and on prefixes one token off."""
    rng = random.Random(3)
    num_true = 0
    for _ in range(400):
        a = TokenRuns(_random_runs(rng))
        cut = rng.randrange(len(a) + 1)
        candidates = [TokenRuns(_random_runs(rng)), a[:cut], a[:cut] + TokenRuns([(9, 0, 1)]), a, TokenRuns(),
                      a + TokenRuns([(rng.randrange(3), rng.randrange(8), 1)]), tuple(a[:cut])]
        for b in candidates:
            assert a.startswith(b) == (a[:len(b)] == b), (a.runs, b)
            num_true += a.startswith(b)
    assert num_true > 800


def test_fresh_uids_are_numbered_as_texts_are() -> None:
    interner = Interner()
    got = [interner.uid("a"), interner.fresh(), interner.uid("b"), interner.uid("a"), interner.fresh(),
           interner.uid("c")]
    assert got == [1, 2, 3, 1, 4, 5]


def test_byte_template_counts_what_the_router_estimates() -> None:
    msgs = (Message("system", "kalo mine", 2), Message("user", "héllo", 1), Message("assistant", "ta", 1))
    body = {"messages": [{"role": m.role, "content": m.content} for m in msgs]}
    assert len(Template("bytes").prompt(msgs, Interner())) == estimate_prompt_tokens_bytes(body)


def test_timeless_pool_sets_what_rowpool_sets() -> None:
    cfg = get_preset("kimi-k3.1-mini")
    layout = plan_layout(cfg)
    real, sim = RowPool(layout, cfg, 4), TimelessRowPool(layout, cfg, 4)
    assert set(vars(real)) == set(vars(sim))
    assert sim.allocate(3) == real.allocate(3)


def test_block_keys_in_one_walk_match_sliced_blocks() -> None:
    rng = random.Random(2)
    for _ in range(300):
        runs = TokenRuns(_random_runs(rng) * rng.randrange(1, 4))
        block = rng.choice((1, 2, 3, 4, 8))
        num = len(runs) // block + rng.randrange(2)  # one block past the end is cut short, as a slice is
        first = rng.randrange(num + 1)
        sliced = [runs[k * block:(k + 1) * block].key_bytes() for k in range(first, num)]
        assert runs.block_key_bytes(block, first, num) == sliced


def test_block_keys_taken_over_from_an_earlier_prompt_match_sliced_blocks() -> None:
    rng = random.Random(3)
    for _ in range(300):
        earlier = TokenRuns(_random_runs(rng))
        later = TokenRuns(list(earlier.runs) + _random_runs(rng))
        other = TokenRuns(_random_runs(rng) + _random_runs(rng))  # not an extension: nothing is taken over
        block = rng.choice((1, 2, 3, 4))
        earlier.block_key_bytes(block, 0, len(earlier) // block)
        for seq in (later, other):
            seq.continues(earlier)
            num = len(seq) // block + rng.randrange(2)
            first = rng.randrange(num + 1)
            sliced = [seq[k * block:(k + 1) * block].key_bytes() for k in range(first, num)]
            assert seq.block_key_bytes(block, first, num) == sliced
            assert seq.block_key_bytes(block, 0, num) == [seq[k * block:(k + 1) * block].key_bytes()
                                                          for k in range(num)]


def test_prompt_from_an_earlier_prompt_equals_the_whole_walk() -> None:
    rng = random.Random(5)
    texts = ["sys", "a b", "c", "tool out", "é", "a b"]
    for template in (Template("bytes"), Template("words", 4), Template("words", 0), Template("words", 1)):
        reused, whole = Interner(), Interner()
        sessions: dict[int, tuple[Message, ...]] = {}
        last: dict[int, tuple[tuple[Message, ...], TokenRuns]] = {}
        for _ in range(200):
            sid = rng.randrange(4)
            new = tuple(Message(rng.choice(("user", "assistant", "tool")), t, len(t.split()))
                        for t in rng.sample(texts, rng.randrange(1, 3)))
            msgs = sessions[sid] = (sessions.get(sid, ()) + new) if rng.random() < 0.8 else new  # or a fresh one
            earlier = last.get(sid) if rng.random() < 0.9 else last.get(rng.randrange(4))  # maybe another's
            got = template.prompt(msgs, reused, earlier)
            assert got.runs == template.prompt(msgs, whole).runs
            last[sid] = (msgs, got)


def test_chained_keys_equal_chain_keys_per_layout_and_taken_over() -> None:
    """`TokenRuns.chained_keys` (kept per block size, fingerprint and root; taken over from a prompt it continues)
    equals the engine's `chain_keys` on the same tokens, for every layout asked in any order, past the full blocks
    included."""
    rng = random.Random(7)
    layouts = [(b, fp, root) for b in (1, 2, 4) for fp in (b"p", b"d") for root in (b"r0", b"r1")]
    for _ in range(300):
        earlier = TokenRuns(_random_runs(rng) * rng.randrange(1, 3))
        later = TokenRuns(list(earlier.runs) + _random_runs(rng))
        for block, fp, root in rng.sample(layouts, 4):
            earlier.chained_keys(block, rng.randrange(len(earlier) // block + 1), fp, root)
        later.continues(earlier)
        for seq in (earlier, later):
            for block, fp, root in rng.sample(layouts, 6):
                num = rng.randrange(len(seq) // block + 2)  # one block past the end is cut short, as a slice is
                fresh = TokenRuns(seq.runs)  # nothing remembered: the engine keys it from scratch
                assert seq.chained_keys(block, num, fp, root) == chain_keys(fresh, block, num, fp, root)


def test_a_continued_prompt_indexes_and_slices_as_a_fresh_one() -> None:
    """A prompt that `continues` an earlier one takes over its run ends (and, with `chained_keys`, walks only the
    blocks past those whose keys it took over): items, slices and block encodings equal a fresh sequence's."""
    rng = random.Random(11)
    for _ in range(300):
        earlier = TokenRuns(_random_runs(rng) * rng.randrange(1, 3))
        earlier[rng.randrange(len(earlier))]  # its run ends computed
        later = TokenRuns(list(earlier.runs) + _random_runs(rng))
        block = rng.choice((1, 2, 3))
        earlier.chained_keys(block, len(earlier) // block, b"f", b"r")
        later.continues(earlier)
        fresh, tokens = TokenRuns(later.runs), list(later)
        lo = rng.randrange(len(later))
        hi = rng.randrange(lo, len(later) + 2)
        assert later[lo] == tokens[lo] and list(later[lo:hi]) == tokens[lo:hi]
        assert later.chained_keys(block, len(later) // block, b"f", b"r") == \
            chain_keys(fresh, block, len(later) // block, b"f", b"r")
        num = len(later) // block + 1
        first = rng.randrange(num + 1)
        assert later.block_key_bytes(block, first, num) == fresh.block_key_bytes(block, first, num)
