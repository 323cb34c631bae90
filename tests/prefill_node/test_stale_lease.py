"""Issue 13's stale lease at node level: a prefill node's Exporter over a real executor and rank process (test
backend). The router's abort lands between the engine's export step and the grant: the grant is refused and the
rows come back at once (no lease, so no reader), and once handed to export B they are never freed by anything
naming A. A claimed lease the node ends keeps its rows from the next export for the read timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.api import EngineConfig, ExportedRows, Release, SamplingParams, Submit
from kv_transfer.ucx_env import KVTransferSettings
from node.executor import Executor, WorkerSpec
from node.metrics import NodeMetrics
from node.rank import WorkerConfig
from kv_transfer.exporter import Exporter, ExportIdentity
from serving.errors import APIError
from tests.node.nodes import TOY

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]
NUM_ROWS = 16


def _executor(quarantine_s: float) -> Executor:
    config = WorkerConfig(engine=EngineConfig(seed=0, num_rows=NUM_ROWS, max_batch=8, quarantine_s=quarantine_s),
                          role="prefill", engine_id="stale-lease", backend=TOY, transport=False,
                          kv=KVTransferSettings(timeout_s=quarantine_s))
    executor = Executor(WorkerSpec(factory="node.worker:build_worker", config=config, step_timeout_s=120))
    executor.start()
    return executor


def _table(executor: Executor, lease_seconds: float = 600.0) -> Exporter:
    identity = ExportIdentity(engine_id="stale-lease", host="127.0.0.1", port=1, tp_size=1, block_size=1024,
                              subblock_tokens=64, layout_fingerprint="fp")
    return Exporter(identity, executor, NodeMetrics("kimi-k3.1-mini", "prefill"), lease_seconds)


async def _export(executor: Executor, request_id: str, prompt: tuple[int, ...]) -> ExportedRows:
    async for event in executor.events(Submit(request_id, prompt, SamplingParams(max_tokens=1), export=True)):
        if isinstance(event, ExportedRows):
            return event
    raise AssertionError(f"{request_id} ended without rows")


def _rows(exported: ExportedRows) -> set[int]:
    return set(exported.attn_row_ids) | set(exported.kda_row_ids)


async def _rounds(executor: Executor, count: int = 3) -> None:
    """Wait until the driver completed `count` more rounds (commands queued before are applied by then)."""
    target = executor.state.rounds + count
    deadline = time.monotonic() + 120
    while executor.state.rounds < target:
        assert time.monotonic() < deadline, "the driver stopped"
        await asyncio.sleep(0.01)


def _rows_used(executor: Executor) -> int:
    return executor.state.stats[0].num_rows_used


async def _abort_before_grant(executor: Executor, table: Exporter, request_id: str) -> ExportedRows:
    """Export `request_id`, then let /abort_requests' path run before the grant (as node/app.py does: the
    table's abort, then the executor's abort of the in-flight request); the grant must be refused."""
    table.begin(request_id)
    exported = await _export(executor, request_id, (256, 1, 2))
    outcome = table.abort(request_id, in_flight=[request_id])
    assert outcome.reads_done and not outcome.ended  # no lease was granted, and none will be
    executor.abort(request_id, reads_done=outcome.reads_done)
    with pytest.raises(APIError) as refused:
        table.grant(request_id, exported, [256, 1, 2])
    assert refused.value.status == 499 and table.num_outstanding == 0
    table.forget(request_id)
    return exported


def test_stale_lease_node_abort_before_grant_cannot_free_reused_rows():
    """Also: A's rows come back at once, not after the (here endless) quarantine: nobody was granted a lease on
    them, so nobody can read them."""
    executor = _executor(quarantine_s=600.0)
    try:
        table = _table(executor)

        async def scenario() -> None:
            a = await _abort_before_grant(executor, table, "A")
            await _rounds(executor)
            assert _rows_used(executor) == 0
            table.begin("B")
            b = await _export(executor, "B", (256, 7, 7))
            params = table.grant("B", b, [256, 7, 7])
            table.forget("B")
            assert _rows(b) == _rows(a)  # the allocator handed B exactly A's rows: what a stale lease would free
            for generation in (a.generation, b.generation + 1):  # what anything still naming A could send
                executor.submit(Release(request_id="A", generation=a.generation, reads_done=True))
                executor.submit(Release(request_id="B", generation=generation, reads_done=True))
            await _rounds(executor)
            assert _rows_used(executor) == len(_rows(b)) and table.holds("B")  # B's rows untouched
            table.leases.claim(params.lease_id, "decode-x")
            assert table.abort_lease(params.lease_id, "decode-x")  # B's own lease ends: B's rows go (into quarantine)
            await _rounds(executor)
            assert _rows_used(executor) == 0 and table.num_outstanding == 0

        asyncio.run(scenario())
    finally:
        executor.stop()


def test_stale_lease_node_quarantine_keeps_aborted_rows_from_the_next_export():
    """A's lease was claimed when the node aborted A: within the read timeout its reader could still READ A's
    rows, so B must get other rows."""
    executor = _executor(quarantine_s=600.0)
    try:
        table = _table(executor, lease_seconds=0.2)

        async def scenario() -> None:
            table.begin("A")
            a = await _export(executor, "A", (256, 1, 2))
            table.claim(str(table.grant("A", a, [256, 1, 2]).lease_id), "decode-x")
            outcome = table.abort("A", in_flight=["A"])  # /abort_requests before A's handler finished
            assert outcome.ended and not outcome.reads_done
            executor.abort("A", reads_done=outcome.reads_done)
            table.forget("A")
            await _rounds(executor)
            assert _rows_used(executor) == 0
            table.begin("B")
            b = await _export(executor, "B", (256, 7, 7))
            params = table.grant("B", b, [256, 7, 7])
            table.forget("B")
            assert not _rows(a) & _rows(b)
            table.claim(str(params.lease_id), "decode-x")  # a reader may be reading B's rows from now on
            await asyncio.sleep(0.3)
            assert table.sweep() and table.num_outstanding == 0  # B's lease expired: its rows are quarantined
            await _rounds(executor)
            assert _rows_used(executor) == 0
            table.begin("C")
            c = await _export(executor, "C", (256, 9, 9))
            assert not (_rows(a) | _rows(b)) & _rows(c)  # neither quarantine is over: C gets fresh rows
            table.forget("C")

        asyncio.run(scenario())
    finally:
        executor.stop()


def test_an_unclaimed_expired_lease_gives_its_rows_back_at_once():
    """Nobody claimed D's lease before it expired, so no reader got the metadata of its rows and none can claim
    it now: the rows are free at once (all of them reused by E), not quarantined for the read timeout."""
    executor = _executor(quarantine_s=600.0)
    try:
        table = _table(executor, lease_seconds=0.2)

        async def scenario() -> None:
            table.begin("D")
            d = await _export(executor, "D", (256, 3, 3))
            table.grant("D", d, [256, 3, 3])
            table.forget("D")
            await asyncio.sleep(0.3)
            assert table.sweep() and table.num_outstanding == 0
            await _rounds(executor)
            assert _rows_used(executor) == 0
            table.begin("E")
            e = await _export(executor, "E", (256, 3, 3))
            assert _rows(e) & _rows(d), "E got none of D's rows: they were held back"
            table.forget("E")

        asyncio.run(scenario())
    finally:
        executor.stop()
