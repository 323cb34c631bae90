"""The driver merges an import's outcomes over every rank, however many rounds apart they come (ranks poll
their READs between steps), and a part that says a READ could not be cancelled makes every rank hold the rows.
Two real rank processes running tests/node/staggered_worker.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.api import ImportKV, ImportOutcome, SamplingParams, StartDecode, TokenEvent
from node.executor import Executor, WorkerSpec

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


def _import(request_id: str) -> ImportKV:
    return ImportKV(request_id=request_id, prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=1),
                    first=TokenEvent(request_id=request_id, token_id=3), params=None, peer=None)


def test_outcome_waits_for_every_rank_and_uncancelled_reads_are_held():
    executor = Executor(WorkerSpec(factory="tests.node.staggered_worker:build", config=None, world_size=2,
                                   pin_cores=False, step_timeout_s=120))
    executor.start(timeout_s=600)
    try:
        async def scenario() -> None:
            events = executor.events(_import("ok"))
            first = await events.__anext__()
            assert isinstance(first, ImportOutcome) and first.error is None
            assert first.num_bytes == 300  # rank 0's part (100) AND rank 1's, 30 rounds later (200)
            executor.submit(StartDecode(request_id="ok"))
            assert isinstance(await events.__anext__(), TokenEvent)
            await events.aclose()
            stuck = [event async for event in executor.events(_import("stuck-1"))]
            assert len(stuck) == 1 and stuck[0].uncancelled and "stalled" in stuck[0].error
            deadline = time.monotonic() + 120
            while not all(dict(s.counters).get("held") == 1.0 for s in executor.state.stats):
                assert time.monotonic() < deadline, executor.state.stats
                await asyncio.sleep(0.01)

        asyncio.run(scenario())
    finally:
        executor.stop()
