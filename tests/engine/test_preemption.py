"""Reserve as you go (engine/scheduler.py): a request is admitted with rows for its prompt plus a small look-ahead
and takes rows as its answer grows, so a huge max_tokens does not hold rows it never fills; when the pool runs out
the request that started last is preempted by recompute, and its answer is still the one it gets alone, token for
token and log-prob for log-prob (greedy and seeded); every row comes back once the requests end.

The model is tests/engine/tiny.py's (mini's layers, 64-token rows, index_topk 32): a prompt of PROMPT_TOKENS (past
the top-k, so the recompute selects) plus the look-ahead fits one attention row, and the answer crosses into a second
one after 24 tokens."""

from __future__ import annotations

import random

import pytest

from engine.engine import Engine, EngineConfig
from engine.outputs import TokenEvent
from engine.sampling import SamplingParams
from engine.scheduler import RESERVE_AHEAD_TOKENS, RequestState
from tests.engine.tiny import TINY

PROMPT_TOKENS = 40
NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11, logprobs=2)


def _prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(1, 250) for _ in range(length - 1)]


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 400
         ) -> dict[str, list[TokenEvent]]:
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling)
    events: dict[str, list[TokenEvent]] = {request_id: [] for request_id in requests}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for event in engine.step().tokens:
            events[event.request_id].append(event)
    assert not engine.has_work, "the requests did not finish"
    return events


def _alone(model: str, prompt: list[int], sampling: SamplingParams, request_id: str) -> list[TokenEvent]:
    """The request on an engine of its own with rows to spare (nothing preempted)."""
    engine = Engine(EngineConfig(model=model, num_rows=8, prefix_cache=False))
    events = _run(engine, {request_id: (prompt, sampling)})[request_id]
    assert engine.scheduler.num_preemptions == 0
    return events


def test_the_prompt_and_look_ahead_fit_one_row_and_the_answer_needs_a_second(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=8, prefix_cache=False))
    assert PROMPT_TOKENS > TINY.index_topk
    assert engine.pool.rows_for(PROMPT_TOKENS + RESERVE_AHEAD_TOKENS)[0] == 1
    assert engine.pool.rows_for(PROMPT_TOKENS + NUM_TOKENS)[0] == 2


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preempted_requests_continue_bit_for_bit(sampling: SamplingParams, tiny_model: str) -> None:
    """Two requests of 3 rows each (1 attention + 2 KDA) in a pool of 7: both answers cross into a second block,
    only one more row is free, so the later one is preempted, re-admitted once the first ends, recomputes its
    prompt + answer so far, and ends with the answer it gets alone."""
    requests = {"first": (_prompt(1), sampling), "second": (_prompt(2), sampling)}
    engine = Engine(EngineConfig(model=tiny_model, num_rows=7, prefix_cache=False))
    events = _run(engine, requests)
    assert engine.scheduler.num_preemptions >= 1
    for request_id, (prompt, params) in requests.items():
        expected = _alone(tiny_model, prompt, params, request_id)
        got = events[request_id]
        assert [e.token_id for e in got] == [e.token_id for e in expected], request_id
        assert [e.logprob for e in got] == [e.logprob for e in expected], request_id
        assert [e.top_logprobs for e in got] == [e.top_logprobs for e in expected], request_id
        assert [e.index for e in got] == list(range(NUM_TOKENS)), "indices continue through the preemption"
        assert {e.num_prompt_tokens for e in got} == {PROMPT_TOKENS}, "usage counts the client's prompt"
        assert got[-1].finish_reason == "length"
    assert engine.pool.num_free == 7 and engine.scheduler.requests == {}, "every row is back"


def test_a_huge_max_tokens_does_not_hold_up_requests_that_fit(tiny_model: str) -> None:
    """'huge' asks for 200 tokens (6 rows if reserved at admission, of a pool of 6); it holds only the rows its
    answer fills, so 'small' runs beside it and ends while 'huge' still runs; every row is back after both."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=6, prefix_cache=False))
    prompt = [256, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    engine.add_request("huge", prompt, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    engine.step()
    engine.add_request("small", prompt, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    done = []
    for _ in range(8):
        done += [t.request_id for t in engine.step().tokens if t.finish_reason is not None]
    assert done == ["small"], done
    assert engine.scheduler.requests["huge"].state == RequestState.RUNNING
    engine.abort("huge")
    assert engine.pool.num_free == 6
