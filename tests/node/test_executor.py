"""The rank executor with real rank processes (gloo group of 2, test backend): lockstep rounds give the
same events as one rank, concurrent requests stream independently, abort frees rows, and a killed rank
fails every in-flight request promptly (no hang) and turns health off."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.api import EngineConfig, EngineFailure, SamplingParams, Submit, TokenEvent
from node.executor import Executor, ExecutorDead, WorkerSpec
from node.rank import WorkerConfig
from tests.node.nodes import TOY

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


def _spec(world: int, process_group: bool = True) -> WorkerSpec:
    config = WorkerConfig(engine=EngineConfig(seed=0, num_rows=32, tp_size=world, max_batch=8), role="decode",
                          engine_id=f"exec-test-{world}", backend=TOY, transport=False)
    return WorkerSpec(factory="node.worker:build_worker", config=config, world_size=world,
                      step_timeout_s=60, process_group=process_group)


async def _tokens(executor: Executor, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    out = []
    async for event in executor.events(Submit(request_id, prompt, SamplingParams(max_tokens=max_tokens))):
        assert isinstance(event, TokenEvent), event
        out.append(event.token_id)
    return out


async def _first_n_then_stop(executor: Executor, request_id: str, n: int) -> None:
    events = executor.events(Submit(request_id, (5, 6, 7), SamplingParams(max_tokens=100000)))
    for _ in range(n):
        await events.__anext__()
    await events.aclose()


def test_two_ranks_lockstep_abort_and_rank_death():
    executor = Executor(_spec(2))
    executor.start()
    try:
        assert executor.healthy and len(executor.pids) == 2

        async def scenario() -> None:
            a, b = await asyncio.gather(_tokens(executor, "a", (1, 2, 3), 20), _tokens(executor, "b", (9, 8), 7))
            assert len(a) == 20 and len(b) == 7
            again = await _tokens(executor, "a2", (1, 2, 3), 20)
            assert again == a  # same prompt, same tokens, whatever else ran beside it
            await _first_n_then_stop(executor, "gone", 3)  # consumer leaves: the request is aborted
            for _ in range(200):
                await asyncio.sleep(0.02)
                if executor.state.stats[0].num_rows_used == 0:
                    break
            assert all(s.num_rows_used == 0 for s in executor.state.stats)

            events = executor.events(Submit("doomed", (4, 4), SamplingParams(max_tokens=100000)))
            await events.__anext__()
            os.kill(executor.pids[1], signal.SIGKILL)
            last = None
            async with asyncio.timeout(30):
                async for event in events:
                    last = event
            assert isinstance(last, EngineFailure) and "rank 1" in last.error

        asyncio.run(scenario())
        assert not executor.healthy
        with pytest.raises(ExecutorDead):
            executor.submit(Submit("late", (1,), SamplingParams(max_tokens=1)))
    finally:
        executor.stop()
    assert not any(p.is_alive() for p in executor._procs)


def test_ranks_outside_a_process_group_never_load_torch():
    """A backend without collectives (the toy's PROCESS_GROUP = False): its ranks load no torch library at all
    and serve the same tokens as ranks in a gloo group."""
    results = {}
    for grouped in (True, False):
        executor = Executor(_spec(2, process_group=grouped))
        executor.start()
        try:
            maps = [open(f"/proc/{pid}/maps").read() for pid in executor.pids]
            assert all(("libtorch" in m) == grouped for m in maps), [("libtorch" in m) for m in maps]
            results[grouped] = asyncio.run(_tokens(executor, "a", (1, 2, 3), 12))
        finally:
            executor.stop()
    assert results[True] == results[False] and len(results[False]) == 12


def test_a_request_id_used_again_after_an_abort_gets_its_own_events():
    """A decode node whose import failed aborts the request and recomputes it under the same id (decode_node/
    importer.py `serve_remote`): the old request's final `abort` event, routed by id, must not end the new one.
    The soak of 18:58 saw this as answers of "" (finish_reason "abort") where the oracle had text."""
    executor = Executor(_spec(1, process_group=False))
    executor.start()
    try:
        async def scenario() -> None:
            alone = await _tokens(executor, "ref", (5, 6, 7), 12)
            for attempt in range(5):
                request_id = f"again-{attempt}"
                events = executor.events(Submit(request_id, (5, 6, 7), SamplingParams(max_tokens=100000)))
                await events.__anext__()
                await events.aclose()  # the consumer leaves: Abort queued
                executor.abort(request_id)  # and the node aborts it once more, as serve_remote does
                async with asyncio.timeout(60):
                    again = await _tokens(executor, request_id, (5, 6, 7), 12)
                assert again == alone, f"attempt {attempt}: {again} != {alone}"

        asyncio.run(scenario())
    finally:
        executor.stop()
