"""Decode priority (engine/api.py `EngineConfig.decode_first_tokens`, engine/scheduler.py `_decode_first`): a prompt
that arrives while short answers are decoding lets them finish in decode-only steps instead of putting a prefill
chunk into each of their steps (on a decode instance that computes a turn itself, those mixed steps are what
stretched the other streams' inter-token gaps: benchmarks/agent_sessions.py), for a bounded number of steps; a
batch with a long answer to go is not waited for; the tokens are the same either way."""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt) % 251 for i in range(n)]


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def _run(tiny_model: str, decode_first: int | None, answer: int) -> tuple[Engine, list]:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=16, prefix_cache=False,
                                 decode_first_tokens=decode_first))
    engine.add_request("stream", _prompt(20, salt=1), _sampling(answer))
    while not engine.scheduler.running:  # the stream's prompt is in, its first token out
        engine.step()
    engine.add_request("turn", _prompt(80, salt=2), _sampling(4))  # 5 chunks of at most 16 tokens
    return engine, _trace(engine)


def _trace(engine: Engine) -> list[tuple[int, tuple[str, ...]]]:
    """Per step until the end: (prompt tokens the step prefilled for "turn", the requests it decoded)."""
    trace = []
    while engine.has_work:
        turn = engine.scheduler.requests.get("turn")
        computed = turn.num_computed if turn is not None else None
        out = engine.step()
        after = turn.num_computed if turn is not None else computed
        decoded = tuple(t.request_id for t in out.tokens if not (t.request_id == "turn" and t.index == 0))
        trace.append(((after or 0) - (computed or 0), decoded))
        assert len(trace) < 500
    return trace


def test_a_short_answer_finishes_in_decode_only_steps(tiny_model: str) -> None:
    _, trace = _run(tiny_model, decode_first=16, answer=12)
    stream_steps = [chunk for chunk, decoded in trace if "stream" in decoded]
    assert stream_steps and all(chunk == 0 for chunk in stream_steps), trace  # no step of the stream prefilled
    assert sum(chunk for chunk, _ in trace) == 80


def test_without_it_every_step_of_the_stream_carries_a_chunk(tiny_model: str) -> None:
    _, trace = _run(tiny_model, decode_first=None, answer=12)
    mixed = [chunk for chunk, decoded in trace if "stream" in decoded and chunk > 0]
    assert len(mixed) == 5, trace  # the old behaviour the setting changes: the turn's 5 chunks ride the stream


def test_a_long_answer_is_not_waited_for(tiny_model: str) -> None:
    """A batch with more than decode_first_tokens to go: the turn's chunks join its steps at once."""
    _, trace = _run(tiny_model, decode_first=4, answer=40)
    first_chunk = next(i for i, (chunk, _) in enumerate(trace) if chunk > 0)
    assert first_chunk == 0, trace


def test_the_wait_is_bounded(tiny_model: str) -> None:
    """A prompt lets the running requests go first for at most decode_first_tokens steps in all, even while new
    short answers keep joining the batch (here an import that starts decoding while the turn waits)."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=16, prefix_cache=False,
                                 decode_first_tokens=3))
    engine.add_request("stream", _prompt(20, salt=1), _sampling(4))
    while not engine.scheduler.running:
        engine.step()
    engine.add_request("turn", _prompt(80, salt=2), _sampling(4))
    turn = engine.scheduler.requests["turn"]
    chunks = []
    for i in range(6):
        if i == 2:  # 3 tokens to go, as many as the bound: without it the turn would wait for this one too
            engine.allocate_for_import("imported", _prompt(30, salt=3), _sampling(4))
            engine.start_decode("imported", 9)
        before = turn.num_computed
        engine.step()
        chunks.append(turn.num_computed - before)
    assert chunks[:3] == [0, 0, 0] and chunks[3] > 0, chunks
    assert turn.num_deferred == 3  # at step 3 "imported" still had 2 tokens to go: the bound, not its end


def test_same_tokens_with_and_without(tiny_model: str) -> None:
    def tokens(decode_first: int | None) -> dict[str, list[int]]:
        engine = Engine(EngineConfig(model=tiny_model, num_rows=48, max_step_tokens=16, prefix_cache=False,
                                     decode_first_tokens=decode_first))
        engine.add_request("stream", _prompt(20, salt=1), _sampling(10))
        engine.step()
        engine.add_request("turn", _prompt(80, salt=2), _sampling(6))
        got: dict[str, list[int]] = {}
        while engine.has_work:
            for t in engine.step().tokens:
                got.setdefault(t.request_id, []).append(t.token_id)
        return got

    assert tokens(16) == tokens(None)


def test_a_negative_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_first_tokens must be >= 0, got -1"):
        EngineConfig(decode_first_tokens=-1)


def test_the_reference_cluster_decode_pools_set_it() -> None:
    """cluster/default.yaml's decode pools give their engines decode priority (the chart's values do alike)."""
    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from decode_node.settings import Settings as DecodeSettings

    pools = [p for p in load_config(DEFAULT_CONFIG_PATH).pools if p.role == "decode"]
    assert pools and {DecodeSettings.model_validate(p.settings).engine.decode_first_tokens for p in pools} == {32}
