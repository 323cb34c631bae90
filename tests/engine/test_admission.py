"""Admission (engine/scheduler.py `_admit_next`): a waiting request whose rows the pool cannot hold yet does not
hold up the smaller requests behind it (they are admitted and finish while it waits), and it is not starved: once
MAX_HEAD_BYPASS requests went ahead of it, the queue waits for it.

These engines reserve prompt + max_tokens at admission (`reserve_ahead_tokens=None`), so a 3000-token max_tokens
stands for a head that does not fit: with reserve as you go (the default, tests/engine/test_preemption.py) only a
prompt can be that large, and the bypass rule is the same."""

from __future__ import annotations

import engine.scheduler as scheduler
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.scheduler import RequestState

LONG = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
PROMPT = [256, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def _engine() -> Engine:
    engine = Engine(EngineConfig(num_rows=8, prefix_cache=False))  # 3 + 2 rows for 3010 tokens, 1 + 2 for 13
    engine.scheduler.reserve_ahead_tokens = None
    return engine


def _finished(engine: Engine, steps: int) -> list[str]:
    done = []
    for _ in range(steps):
        done += [t.request_id for t in engine.step().tokens if t.finish_reason is not None]
    return done


def test_a_request_that_does_not_fit_yet_lets_smaller_ones_go_first() -> None:
    engine = _engine()
    engine.add_request("running", PROMPT, LONG)
    _finished(engine, 2)
    engine.add_request("huge", PROMPT, LONG)  # 5 rows: only 3 are free while "running" runs
    for i in range(3):
        engine.add_request(f"small-{i}", PROMPT, SHORT)
    done = _finished(engine, 30)
    assert done == ["small-0", "small-1", "small-2"], done
    assert engine.scheduler.requests["huge"].state == RequestState.WAITING
    assert engine.scheduler.requests["running"].state == RequestState.RUNNING


def test_the_waiting_request_is_not_starved(monkeypatch) -> None:
    monkeypatch.setattr(scheduler, "MAX_HEAD_BYPASS", 2)
    engine = _engine()
    engine.add_request("running", PROMPT, LONG)
    _finished(engine, 2)
    engine.add_request("huge", PROMPT, LONG)
    for i in range(4):
        engine.add_request(f"small-{i}", PROMPT, SHORT)
    assert _finished(engine, 40) == ["small-0", "small-1"]  # then the queue waits for "huge"
    assert engine.scheduler.requests["huge"].num_bypassed == 2
    assert [r.request_id for r in engine.scheduler.waiting] == ["huge", "small-2", "small-3"]
    engine.abort("running")  # rows come back: the head goes first, then the rest
    assert _finished(engine, 40) == ["small-2", "small-3"]
    assert engine.scheduler.requests["huge"].state == RequestState.RUNNING
