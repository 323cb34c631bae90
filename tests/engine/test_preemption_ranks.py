"""Preemption by recompute on real rank processes (gloo, the reference backend through the node's executor):
TP=2 (token-sharded prefill, TP decode) and DCP=2 (the recompute is a DCP node's local prefill, each rank keeping
its tokens; DCP decode). Two requests whose prompts fit a pool of 7 rows but whose answers do not: the one that
started last is preempted on every rank at the same step (the ranks' schedulers decide alike; rank 0 reports the
count), recomputed once the other ends, and both answers equal
what one rank computes for each request alone, token for token and log-prob for log-prob (greedy and seeded).
The single-rank case is tests/engine/test_preemption.py.

Rows (kimi-k3.1-mini): a request holds one attention row per block plus 2 KDA rows; TP=2 rows hold 512 tokens,
DCP=2 rows 1024 (engine/layout.py). Each prompt plus the admission look-ahead fits one attention row (3 rows a
request, 6 of 7 taken), each answer crosses into a second attention row, and only one row is free."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import EngineConfig, SamplingParams, Submit, TokenEvent
from engine.engine import Engine
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.scheduler import RESERVE_AHEAD_TOKENS
from node.executor import Executor, WorkerSpec
from node.rank import WorkerConfig

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

MODEL = "kimi-k3.1-mini"
NUM_ROWS = 7
CASES = {"tp2": (1, 480, 48), "dcp2": (2, 1000, 32)}
"""Case -> (dcp size, prompt tokens, answer tokens)."""


def _sampling(kind: str, max_tokens: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=2)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11, logprobs=2)


def _prompt(num_tokens: int, salt: int) -> list[int]:
    return [256] + [(i * 37 + salt) % 251 for i in range(num_tokens - 1)]


def _executor(dcp: int, name: str) -> Executor:
    engine = EngineConfig(num_rows=NUM_ROWS, tp_size=2, dcp_size=dcp, max_batch=8, prefix_cache=False)
    config = WorkerConfig(engine=engine, role="decode", engine_id=f"preempt-{name}", transport=False,
                          token_shard_min_tokens=1)
    return Executor(WorkerSpec(factory="node.worker:build_worker", config=config, world_size=2, step_timeout_s=600))


async def _serve(executor: Executor, requests: dict[str, tuple[list[int], SamplingParams]]
                 ) -> dict[str, list[TokenEvent]]:
    async def one(request_id: str, prompt: list[int], sampling: SamplingParams) -> list[TokenEvent]:
        events = []
        async for event in executor.events(Submit(request_id, tuple(prompt), sampling)):
            assert isinstance(event, TokenEvent), event
            events.append(event)
        return events

    # both in one round: the first is admitted (and starts) first, so the second is the one preempted
    answers = await asyncio.gather(*(one(rid, *request) for rid, request in requests.items()))
    return dict(zip(requests, answers))


def _alone(request_id: str, prompt: list[int], sampling: SamplingParams) -> list[TokenEvent]:
    """The request on one rank of its own with rows to spare (nothing preempted)."""
    engine = Engine(EngineConfig(num_rows=16, prefix_cache=False))
    engine.add_request(request_id, prompt, sampling)
    events = []
    while engine.has_work:
        events += engine.step().tokens
    assert engine.scheduler.num_preemptions == 0
    return events


@pytest.mark.parametrize("case", CASES)
def test_preempted_requests_on_parallel_ranks_equal_their_answers_alone(case: str) -> None:
    dcp, prompt_tokens, num_tokens = CASES[case]
    block = plan_layout(get_preset(MODEL), tp_size=2, dcp_size=dcp).block_size
    assert prompt_tokens + RESERVE_AHEAD_TOKENS <= block < prompt_tokens + num_tokens, "the rows this test needs"
    requests = {"first": (_prompt(prompt_tokens, 1), _sampling("greedy", num_tokens)),
                "second": (_prompt(prompt_tokens, 2), _sampling("seeded", num_tokens))}
    executor = _executor(dcp, case)
    executor.start(timeout_s=600)
    try:
        served = asyncio.run(_serve(executor, requests))
        preemptions = dict(executor.state.stats[0].counters).get("num_preemptions", 0)  # rank 0 speaks for all
        rows_used = [stats.num_rows_used for stats in executor.state.stats]
    finally:
        executor.stop()
    assert preemptions >= 1, "the pool was meant to run out"
    assert rows_used == [0, 0], "every row is back on every rank"
    for request_id, (prompt, sampling) in requests.items():
        want, got = _alone(request_id, prompt, sampling), served[request_id]
        assert [e.token_id for e in got] == [e.token_id for e in want], request_id
        assert [e.logprob for e in got] == [e.logprob for e in want], request_id  # bit for bit
        assert [e.top_logprobs for e in got] == [e.top_logprobs for e in want], request_id
        assert [e.index for e in got] == list(range(num_tokens)), "indices continue through the preemption"
        assert {e.num_prompt_tokens for e in got} == {prompt_tokens}, "usage counts the client's prompt"
