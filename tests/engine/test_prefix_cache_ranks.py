"""Prefix cache and chunked prefill over real rank processes (gloo, the reference backend through the node's
executor): TP=2 (token-sharded prefill, TP decode) and DCP=2 (a resumed or chunked prefill all-gathers the owned
prefix rows; DCP decode). A session's second turn resumes from the cache and serves exactly the tokens and
log-probs of one rank computing it from scratch, and so does a third turn that resumes from the second's prompt
tail; the node's cache report names the session."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import EngineConfig, SamplingParams, Submit, TokenEvent
from engine.engine import Engine, EngineConfig
from node.executor import Executor, WorkerSpec
from node.rank import WorkerConfig

pytestmark = [pytest.mark.process, pytest.mark.timeout(1200)]

SPEC = SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True, logprobs=1)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [256] + [(i * 37 + salt) % 251 for i in range(n - 1)]


def _executor(dcp: int) -> Executor:
    engine = EngineConfig(num_rows=32, tp_size=2, dcp_size=dcp, max_batch=8, prefix_cache=True, max_step_tokens=200)
    config = WorkerConfig(engine=engine, role="decode", engine_id=f"cache-ranks-{dcp}", transport=False,
                          token_shard_min_tokens=1)
    return Executor(WorkerSpec(factory="node.worker:build_worker", config=config, world_size=2, step_timeout_s=300))


async def _serve(executor: Executor, request_id: str, prompt: list[int], session: str) -> list[TokenEvent]:
    events = []
    async for event in executor.events(Submit(request_id, tuple(prompt), SPEC, session=session)):
        assert isinstance(event, TokenEvent), event
        events.append(event)
    return events


def _scratch(prompt: list[int]) -> list:
    engine = Engine(EngineConfig(num_rows=48, prefix_cache=False))
    engine.add_request("scratch", prompt, SPEC)
    events = []
    while engine.has_work:
        events += engine.step().tokens
    return events


@pytest.mark.parametrize("dcp", [1, 2], ids=["tp2", "dcp2"])
def test_second_turn_resumes_and_equals_one_rank_from_scratch(dcp: int) -> None:
    executor = _executor(dcp)
    executor.start(timeout_s=600)
    try:
        prompt = _prompt(1100)
        turn1 = asyncio.run(_serve(executor, "t1", prompt, "5e55"))
        prompt2 = prompt + [e.token_id for e in turn1] + _prompt(60, salt=4)
        turn2 = asyncio.run(_serve(executor, "t2", prompt2, "5e55"))
        report = executor.state.cache
        # turn 3 carries another text of turn 2's answer: it resumes at turn 2's prompt tail (the prompt's end)
        prompt3 = prompt2 + [(e.token_id + 1) % 251 for e in turn2] + _prompt(40, salt=6)
        turn3 = asyncio.run(_serve(executor, "t3", prompt3, "5e55"))
    finally:
        executor.stop()
    block = report.block_tokens
    assert turn1[0].num_cached_tokens == 0
    # turn 2 resumes at turn 1's exact end (its tail: last partial block + KDA state, on every rank)
    assert turn2[0].num_cached_tokens == len(prompt) + len(turn1) - 1
    assert turn3[0].num_cached_tokens == len(prompt2)
    for served, prompt_ids in ((turn1, prompt), (turn2, prompt2), (turn3, prompt3)):
        want = _scratch(prompt_ids)
        assert [e.token_id for e in served] == [e.token_id for e in want]
        assert [e.logprob for e in served] == [e.logprob for e in want]  # bit for bit
    turn2_end = len(prompt2) + len(turn2) - 1
    assert dict(report.resumable)["5e55"] == turn2_end
    assert dict(report.sessions)["5e55"] == turn2_end // block * block  # whole blocks: what an import reuses
    assert report.hits_tokens == turn2[0].num_cached_tokens
