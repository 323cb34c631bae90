"""Prefix cache and chunked prefill on one rank: hits are bit-exact, rows are accounted, leases stay sole owners.

The model is tests/engine/tiny.py's (mini's layers with 64-token blocks), so the sessions here run past 64 tokens
where mini's ran past 1024. Every equality is exact (token ids and float log-probs), against an engine with the cache
off computing the same request from scratch.
"""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.scheduler import RequestState
from tests.engine.tiny import TINY_BLOCK

BLOCK = TINY_BLOCK


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [256] + [(i * 37 + salt) % 251 for i in range(n - 1)]


def _sampling(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1, temperature=0.7, seed=5, **kw)


def _run(engine: Engine, request_id: str, prompt: list[int], sampling: SamplingParams, session: str = ""):
    engine.add_request(request_id, prompt, sampling, session=session)
    events = []
    while not events or events[-1].finish_reason is None:
        events += [e for e in engine.step().tokens if e.request_id == request_id]
    return events


def _same(a, b) -> None:
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.logprob for e in a] == [e.logprob for e in b]  # exact
    assert [e.top_logprobs for e in a] == [e.top_logprobs for e in b]


@pytest.fixture(scope="module")
def scratch(tiny_model: str) -> Engine:
    return Engine(EngineConfig(model=tiny_model, num_rows=48, prefix_cache=False))


def _accounted(engine: Engine) -> None:
    """Every row is free, quarantined, a cache block's or tail's, or a live request's own - exactly once."""
    pool, cache = engine.pool, engine.cache
    cached = [r for b in cache.blocks.values() for r in b.rows] + [r for t in cache.tails.values() for r in t.rows]
    live = [r for req in engine.scheduler.requests.values() if req.table is not None for r in req.table.row_ids
            if r not in {b.attn_row for b in req.cached_blocks}]
    live += [r for req in engine.scheduler.requests.values() for r in req.prompt_state or ()]
    quarantined = [r for q in pool._quarantine for r in q.row_ids]
    everything = cached + live + quarantined + list(pool._free)
    assert sorted(everything) == list(range(pool.num_rows))


class _CountingPool:
    """Rows handed out in order, never reused (the random-operation tests' pool)."""

    def __init__(self) -> None:
        self.next = 0

    def rows(self, n: int) -> tuple[int, ...]:
        self.next += n
        return tuple(range(self.next - n, self.next))

    def free(self, rows) -> None:  # noqa: ANN001
        pass


def test_session_turns_hit_and_equal_scratch(scratch: Engine, tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48))
    prompt = _prompt(70)
    turn1 = _run(engine, "t1", prompt, _sampling(), session="ab")
    assert turn1[-1].num_cached_tokens == 0
    _same(turn1, _run(scratch, "s1", prompt, _sampling()))
    # turn 2 extends turn 1 (prompt + answer + new text): it resumes at turn 1's exact end (its tail: the
    # partial block and the KDA state after the last written token; the last sampled token was never fed)
    turn1_end = len(prompt) + len(turn1) - 1
    assert dict(engine.cache_report().resumable)["ab"] == turn1_end
    prompt2 = prompt + [e.token_id for e in turn1] + _prompt(40, salt=3)
    turn2 = _run(engine, "t2", prompt2, _sampling(), session="ab")
    assert {e.num_cached_tokens for e in turn2} == {turn1_end}
    _same(turn2, _run(scratch, "s2", prompt2, _sampling()))
    report = engine.cache_report()
    assert dict(report.sessions)["ab"] == BLOCK and report.hits_tokens == turn1_end
    assert report.queried_tokens == len(prompt) + len(prompt2)
    _accounted(engine)


def test_decode_boundary_snapshot_resumes_the_answer(scratch: Engine, tiny_model: str) -> None:
    """A turn whose answer crosses a block boundary leaves a snapshot there: a prompt that shares the turn only
    up to past that boundary resumes from it; one that extends the whole turn resumes from the turn's tail."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48))
    prompt = _prompt(40, salt=1)
    turn1 = _run(engine, "a1", prompt, _sampling(max_tokens=40), session="cd")
    answer = [e.token_id for e in turn1]
    assert dict(engine.cache_report().resumable)["cd"] == len(prompt) + len(answer) - 1  # the tail
    # diverges after the boundary (first 30 answer tokens only): the block snapshot at 64
    branch = prompt + answer[:30] + _prompt(30, salt=5)
    other = _run(engine, "a3", branch, _sampling())
    assert other[0].num_cached_tokens == BLOCK
    _same(other, _run(scratch, "b3", branch, _sampling()))
    prompt2 = prompt + answer + _prompt(30, salt=4)
    turn2 = _run(engine, "a2", prompt2, _sampling())
    assert turn2[0].num_cached_tokens == len(prompt) + len(answer) - 1
    _same(turn2, _run(scratch, "b2", prompt2, _sampling()))
    _accounted(engine)


def test_prompt_tail_resumes_a_turn_whose_answer_text_differs(scratch: Engine, tiny_model: str) -> None:
    """Agent clients send the next turn as prompt + their own text of the answer, which need not be the sampled
    tokens: the turn then resumes at the previous prompt's exact end (the prompt tail), not at its last block
    boundary, and equals the request computed from scratch."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=20))
    prompt = _prompt(90, salt=21)
    turn1 = _run(engine, "p1", prompt, _sampling(max_tokens=12), session="ef")
    assert dict(engine.cache_report().resumable)["ef"] == len(prompt) + len(turn1) - 1
    assert len(engine.cache.tails) == 2
    other_answer = [(e.token_id + 1) % 251 for e in turn1]
    prompt2 = prompt + other_answer + _prompt(10, salt=22)
    turn2 = _run(engine, "p2", prompt2, _sampling(), session="ef")
    assert {e.num_cached_tokens for e in turn2} == {len(prompt)}
    _same(turn2, _run(scratch, "q2", prompt2, _sampling()))
    # the same text again resumes at turn 2's own tail; turn 1's prompt tail was replaced by turn 2's
    turn3 = _run(engine, "p3", prompt2 + [e.token_id for e in turn2] + [7, 8], _sampling(), session="ef")
    assert turn3[0].num_cached_tokens == len(prompt2) + len(turn2) - 1
    assert all(t.end != len(prompt) for t in engine.cache.tails.values())
    _accounted(engine)


def test_prompt_state_of_an_aborted_import_is_freed(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=16))
    prompt = _prompt(94, salt=23)
    free = engine.num_free_rows
    engine.allocate_for_import("imp", prompt, _sampling())
    engine.start_decode("imp", 5)
    req = engine.scheduler.requests["imp"]
    assert req.prompt_state is not None and len(req.prompt_state) == len(req.table.kda_row_ids)
    _accounted(engine)
    engine.abort("imp")
    _accounted(engine)
    assert engine.num_available_rows == free  # the published first block stays cached, evictable


def test_prompt_state_copies_never_keep_a_request_out(scratch: Engine, tiny_model: str) -> None:
    """The prompt-state copy is opportunistic: when an admission is short of rows, copies are given up."""
    probe = Engine(EngineConfig(model=tiny_model, num_rows=8))
    prompt_a, prompt_b = _prompt(94, salt=24), _prompt(70, salt=25)
    rows_a, rows_b = (sum(probe.pool.rows_for(len(p) + m)) for p, m in ((prompt_a, 30), (prompt_b, 4)))
    num_kda = probe.pool.rows_for(1)[1]
    # a's rows, b's rows and the KDA snapshot at a's last block boundary: b fits only without a's copy
    engine = Engine(EngineConfig(model=tiny_model, num_rows=rows_a + rows_b + num_kda))
    engine.add_request("a", prompt_a, _sampling(max_tokens=30))
    events = {"a": [], "b": []}
    while engine.request_state("a") != RequestState.RUNNING:
        for e in engine.step().tokens:
            events[e.request_id].append(e)
    req_a = engine.scheduler.requests["a"]
    assert req_a.prompt_state is not None  # the copy took rows b will need
    engine.add_request("b", prompt_b, _sampling(max_tokens=4))
    for e in engine.step().tokens:
        events[e.request_id].append(e)
    assert engine.request_state("b") != RequestState.WAITING and engine.request_state("a") == RequestState.RUNNING
    assert req_a.prompt_state is None
    _accounted(engine)
    while engine.has_work:
        for e in engine.step().tokens:
            events[e.request_id].append(e)
    _same(events["a"], _run(scratch, "sa", prompt_a, _sampling(max_tokens=30)))
    _same(events["b"], _run(scratch, "sb", prompt_b, _sampling(max_tokens=4)))
    _accounted(engine)


def test_chunked_prefill_interleaves_decodes_and_equals_one_shot(scratch: Engine, tiny_model: str) -> None:
    """A long prompt arriving while 4 streams run: every step that computes one of its chunks also gives each
    stream its next token, so no stream waits longer than one chunk's compute."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=32, prefix_cache=False))
    streams = [f"short{i}" for i in range(4)]
    for i, rid in enumerate(streams):
        engine.add_request(rid, _prompt(20, salt=30 + i), _sampling(max_tokens=40))
    events = {rid: [] for rid in [*streams, "long"]}
    while any(engine.request_state(rid) != RequestState.RUNNING for rid in streams):
        for e in engine.step().tokens:
            events[e.request_id].append(e)
    long_prompt = _prompt(300, salt=2)
    engine.add_request("long", long_prompt, _sampling())
    req = engine.scheduler.requests["long"]
    progress = []
    while engine.has_work:
        before = req.num_computed
        out = engine.step()
        for e in out.tokens:
            events[e.request_id].append(e)
        progress.append((req.num_computed - before, {e.request_id for e in out.tokens}))
    chunks = [(n, decoded) for n, decoded in progress if n > 0]
    assert len(chunks) >= 300 // 32  # the long prompt took many steps...
    assert all(n <= 32 - len(streams) for n, _ in chunks)  # ...each within the budget the 4 decodes leave...
    assert all(set(streams) <= decoded for _, decoded in chunks)  # ...and every stream decoded in each of them
    assert all(len(events[rid]) == 40 for rid in streams)
    _same(events["long"], _run(scratch, "one-shot", long_prompt, _sampling()))


def test_chunked_prompt_logprobs_equal_one_shot(scratch: Engine, tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=100))
    prompt = _prompt(300, salt=6)
    sampling = SamplingParams(max_tokens=0, prompt_logprobs=2)
    chunked, whole = [], []
    for eng, sink, rid in ((engine, chunked, "c"), (scratch, whole, "w")):
        eng.add_request(rid, prompt, sampling)
        while eng.has_work:
            sink += [p for p in eng.step().prompt_logprobs if p.request_id == rid]
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in chunked[0].tokens] == \
        [(t.token_id, t.logprob, t.top_logprobs) for t in whole[0].tokens][:len(chunked[0].tokens)]
    assert len(chunked[0].tokens) == len(prompt)


def test_eviction_under_row_pressure_keeps_results_and_never_frees_used_blocks(scratch: Engine, tiny_model: str) -> None:
    # 8 rows: one request of 70 tokens + 6 new uses 2 attention + 2 KDA rows; a snapshot 2 more
    engine = Engine(EngineConfig(model=tiny_model, num_rows=8))
    shared = _prompt(70, salt=7)
    first = _run(engine, "p0", shared, _sampling())
    assert engine.cache.num_blocks == 1
    # two requests share the cached block at once; finishing one must leave the other's rows intact
    engine.add_request("x", shared + [1, 2, 3], _sampling(max_tokens=12))
    engine.add_request("y", shared + [4, 5], _sampling(max_tokens=4))
    got = {"x": [], "y": []}
    while engine.has_work:
        for e in engine.step().tokens:
            got[e.request_id].append(e)
        _accounted(engine)
    _same(got["x"], _run(scratch, "sx", shared + [1, 2, 3], _sampling(max_tokens=12)))
    _same(got["y"], _run(scratch, "sy", shared + [4, 5], _sampling(max_tokens=4)))
    assert got["x"][0].num_cached_tokens == BLOCK
    # other long prompts push the cached block out (LRU, only when free rows run out)
    for i in range(3):
        _run(engine, f"o{i}", _prompt(70, salt=20 + i), _sampling())
        _accounted(engine)
    assert engine.cache.counters.evicted_blocks > 0
    again = _run(engine, "p1", shared, _sampling())
    _same(again, first)


def test_exports_share_blocks_and_releases_free_only_their_own_rows(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=16, quarantine_s=10.0))
    now = [0.0]
    engine.clock = lambda: now[0]
    prompt = _prompt(70, salt=9)
    a = engine.prefill_and_keep("e", prompt, SamplingParams(max_tokens=1))
    b = engine.prefill_and_keep("f", prompt + [7, 7], SamplingParams(max_tokens=1))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == BLOCK
    assert a.attn_row_ids[0] == b.attn_row_ids[0]  # the shared, cached block
    block = engine.cache.blocks[engine.scheduler.requests["f"].block_keys[0]]
    assert block.refs == 2
    assert not engine.release("e", b.generation)  # a stale / foreign generation frees nothing
    assert engine.release("e", a.generation)  # given up: its own rows quarantined, the shared block pinned
    assert block.refs == 1 and block.pinned_until == 10.0
    assert a.attn_row_ids[1] not in engine.pool._free
    _accounted(engine)
    assert engine.release("f", b.generation, reads_done=True)
    assert block.refs == 0 and engine.cache.evictable_rows() == 0  # pinned: no READ target is reused early
    now[0] = 11.0
    engine.reclaim()
    assert engine.cache.evictable_rows() == len(block.rows)
    _accounted(engine)


def test_import_reuses_held_blocks_and_is_told_what_to_read(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=16))
    prompt = _prompt(131, salt=11)
    _run(engine, "warm", prompt[:94], _sampling())
    table = engine.allocate_for_import("imp", prompt, _sampling())
    assert engine.num_reused_tokens("imp") == BLOCK
    held = engine.cache.lookup(engine.cache.keys(prompt, 1))
    assert table.attn_row_ids[0] == held[0].attn_row
    report = engine.cache_report()
    assert (report.blocks_reused, report.blocks_read) == (1, 2)
    engine.abort("imp")
    _accounted(engine)


def test_cache_off_reuses_nothing(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, prefix_cache=False))
    prompt = _prompt(70, salt=12)
    _run(engine, "o1", prompt, _sampling(), session="ef")
    second = _run(engine, "o2", prompt + [3], _sampling(), session="ef")
    assert second[0].num_cached_tokens == 0
    report = engine.cache_report()
    assert report.blocks_cached == 0 and report.sessions == ()


def test_block_bytes_of_ids_and_of_a_self_encoding_sequence() -> None:
    from engine.prefix_cache import block_bytes, chain_keys

    assert block_bytes([1, 256, 70000]) == b"\x01\x00\x00\x00\x00\x01\x00\x00\x70\x11\x01\x00"

    class Encoded(list):
        def key_bytes(self) -> bytes:
            return b"runs:" + bytes(len(self))

        def __getitem__(self, index):  # noqa: ANN001 - slices stay self-encoding, as the simulator's do
            got = super().__getitem__(index)
            return Encoded(got) if isinstance(index, slice) else got

    assert block_bytes(Encoded([5, 6])) == b"runs:\x00\x00"
    assert chain_keys(Encoded([5, 6]), 2, 1, b"fp") != chain_keys([5, 6], 2, 1, b"fp")


def test_evictable_rows_counts_equal_the_walk_under_random_operations() -> None:
    """The kept counts of `evictable_rows` against `naive_evictable_rows` (a walk over every block and tail) after
    every operation of a random mix: acquire/release with pins, inserts with and without snapshots, dropped
    snapshots, tails added, taken and put back, evictions, the clock moving."""
    import random

    from engine.prefix_cache import CachedTail, PrefixCache

    rng = random.Random(0)
    pool = _CountingPool()
    cache = PrefixCache(pool, 4, b"fp")
    held: list = []
    tails: list = []
    for step in range(3000):
        op = rng.randrange(8)
        if op == 0:
            key = bytes([rng.randrange(40)])
            block = cache.insert(key, 0, pool.rows(1)[0], pool.rows(2) if rng.random() < 0.5 else None)
            if block is not None:
                held.append(block)
        elif op == 1 and held:
            block = held.pop(rng.randrange(len(held)))
            cache.release([block], pin_until=cache.now + rng.random() * 3 if rng.random() < 0.3 else None)
        elif op == 2:
            blocks = list(cache.blocks.values())
            if blocks:
                block = rng.choice(blocks)
                cache.acquire([block])
                held.append(block)
        elif op == 3 and cache.blocks:
            cache.drop_snapshot(rng.choice(list(cache.blocks.values())))
        elif op == 4:
            tail = CachedTail(b"p", rng.randrange(3), (rng.randrange(5),), 1, pool.rows(1)[0], pool.rows(2))
            cache.add_tail(tail)
            tails.append(tail)
        elif op == 5 and tails:
            tail = rng.choice(tails)
            if id(tail) in cache.tails:
                cache.take_tail(tail)
                cache.put_back_tail(tail)
        elif op == 6:
            cache.evict(rng.randrange(1, 6))
        else:
            cache.now += rng.random()
        assert cache.evictable_rows() == cache.naive_evictable_rows(), step


def test_held_figures_equal_held_tokens_plain_and_resumable_under_random_operations() -> None:
    """`held_figures` (one walk of the blocks for both figures of a cache report) against `held_tokens` plain and
    with snapshots and tails, and `resumable_of(lookup)` against `resumable`, for random key chains after random
    inserts (with and without snapshots), dropped snapshots, tails of any block (their parents matching the
    chains or not), taken tails and evictions."""
    import random

    from engine.prefix_cache import CachedTail, PrefixCache, resumable_of

    rng = random.Random(2)
    pool = _CountingPool()
    cache = PrefixCache(pool, 4, b"fp")
    universe = [bytes([i]) for i in range(6)]
    made: list[CachedTail] = []
    num_resumed_by_tail = 0
    for step in range(2000):
        op = rng.randrange(6)
        if op <= 1:
            block = cache.insert(rng.choice(universe), 0, pool.rows(1)[0], pool.rows(2) if rng.random() < 0.6 else None)
            if block is not None:
                cache.release([block])
        elif op == 2 and cache.blocks:
            cache.drop_snapshot(rng.choice(list(cache.blocks.values())))
        elif op == 3:
            index = rng.randrange(5)
            parent = rng.choice(universe) if index else b"root"
            tail = CachedTail(parent, index, (step,), index * 4 + rng.randrange(1, 4), pool.rows(1)[0], pool.rows(2))
            cache.add_tail(tail)
            made.append(tail)
        elif op == 4 and made:
            tail = rng.choice(made)
            if id(tail) in cache.tails:
                cache.take_tail(tail)
        elif op == 5:
            cache.evict(rng.randrange(1, 4))
        for _ in range(3):
            keys = rng.sample(universe, rng.randrange(len(universe) + 1))
            tails = rng.sample(made, min(len(made), rng.randrange(4)))
            expected = (cache.held_tokens(keys), cache.held_tokens(keys, snapshot=True, tails=tails))
            assert cache.held_figures(keys, tails) == expected, step
            assert resumable_of(cache.lookup(keys)) == cache.resumable(keys), step
            num_resumed_by_tail += expected[1] > len(cache.resumable(keys)) * 4
    assert num_resumed_by_tail > 0, "no tail ever extended a held prefix: the tails' branch went untested"


def test_add_tail_drops_what_the_walk_over_every_tail_drops() -> None:
    """`add_tail` looks only at the tails of the new tail's start; against `naive_add_tail` (the walk over every
    tail) after random adds, uses (taken and put back, or put back while held), and evictions: the same tails in
    the same order, and the same rows freed in the same order (the pool hands rows out in the order it got them)."""
    import random

    from engine.prefix_cache import CachedTail, PrefixCache

    class Pool:
        def __init__(self) -> None:
            self.freed: list[int] = []

        def free(self, rows) -> None:  # noqa: ANN001
            self.freed += rows

    def naive_add_tail(cache: PrefixCache, tail: CachedTail) -> None:
        for key, old in list(cache.tails.items()):
            if old.parent == tail.parent and old.index == tail.index and tail.tokens[:len(old.tokens)] == old.tokens:
                cache._tail_drop(key)
                cache.pool.free(old.rows)
        cache._tail_put(tail)

    rng = random.Random(1)
    fast, naive = PrefixCache(Pool(), 4, b"fp"), PrefixCache(Pool(), 4, b"fp")
    made: list[CachedTail] = []
    for step in range(3000):
        op = rng.randrange(6)
        if op < 3:
            tokens = tuple(rng.choice((1, 2)) for _ in range(rng.randrange(1, 5)))
            tail = CachedTail(rng.choice((b"p", b"q")), rng.randrange(2), tokens, 9, step, (step, step))
            fast.add_tail(tail)
            naive_add_tail(naive, tail)
            made.append(tail)
        elif op == 3 and made:
            tail = rng.choice(made)
            if id(tail) in fast.tails:
                if rng.random() < 0.5:
                    fast.take_tail(tail)
                    naive.take_tail(tail)
                fast.put_back_tail(tail)
                naive.put_back_tail(tail)
        elif op == 4:
            n = rng.randrange(1, 4)
            assert fast.evict(n) == naive.evict(n)
        assert list(fast.tails) == list(naive.tails), step
        assert fast.pool.freed == naive.pool.freed, step
    assert naive.pool.freed


def test_published_keys_are_the_chained_keys_of_the_tokens(tiny_model: str) -> None:
    """`publish` takes the keys admission computed for the prompt's blocks (`Request.prompt_keys`) and hashes only
    the blocks past them: every published key equals the key chained from the request's own tokens, for a fresh
    prompt, one that resumes from a held block, and an answer that runs into a new block."""
    from engine.prefix_cache import chain_keys

    engine = Engine(EngineConfig(model=tiny_model, num_rows=48))
    first = _prompt(131, salt=21)
    engine.prefill_and_keep("a", first, SamplingParams(max_tokens=1))
    longer = first + _prompt(70, salt=22)
    engine.prefill_and_keep("b", longer, SamplingParams(max_tokens=1))
    for rid, tokens in (("a", first), ("b", longer)):
        req = engine.scheduler.requests[rid]
        assert req.block_keys == chain_keys(tokens, BLOCK, len(tokens) // BLOCK, engine.cache.fingerprint,
                                            req.cache_root)
        assert set(req.block_keys) <= set(engine.cache.blocks)
    assert engine.scheduler.requests["b"].num_cached_tokens >= BLOCK
