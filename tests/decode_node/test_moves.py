"""A draining decode node's moves (decode_node/moves.py), node side, over a recording executor (the engine's export
is tests/engine/test_move_out.py, the READ and the continuation tests/e2e/test_resume_cluster.py): a stream's
export becomes the failure that carries its lease, bound to prompt + the tokens streamed; an export that does not
match what was streamed is released and recomputed; the hand-off sends `MoveOut` to the movable streams and ends
only the others; an import whose KV is arriving when the hand-off comes moves too, one that has not reached the ranks
and a stream that had not started are handed back (a plain 503) before anything is computed for them here."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from decode_node.moves import DRAIN_MESSAGE, HandedBack, Moves
from engine.api import EngineFailure, ExportedRows, MoveOut, Release, SamplingParams
from engine.outputs import TokenEvent
from kv_transfer.exporter import Exporter, ExportIdentity
from kv_transfer.lease import ClaimRefused
from kv_transfer.signing import prompt_digest
from node.metrics import NodeMetrics
from node.textgen import PreparedRequest

PROMPT = (5, 6, 7)


class RecordingExecutor:
    healthy = True

    def __init__(self) -> None:
        self.commands: list = []
        self.ended_keep: list[frozenset[str]] = []

    def submit(self, cmd) -> None:
        self.commands.append(cmd)

    def on_notice(self, handler) -> None:
        pass

    def abort(self, request_id: str) -> bool:
        self.commands.append(("abort", request_id))
        return True

    def end_all(self, message: str, status: int = 500, keep: frozenset[str] = frozenset()) -> int:
        self.ended_keep.append(keep)
        return 0


def _moves() -> tuple[Moves, SimpleNamespace]:
    executor = RecordingExecutor()
    metrics = NodeMetrics("kimi-k3.1-mini", "decode")
    identity = ExportIdentity(engine_id="d-moves", host="127.0.0.1", port=1, tp_size=1, block_size=1024,
                              subblock_tokens=64, layout_fingerprint="fp")
    return Moves(Exporter(identity, executor, metrics, 60.0), wait_s=5.0), SimpleNamespace(executor=executor,
                                                                                          metrics=metrics)


def _prepared(request_id: str) -> PreparedRequest:
    return PreparedRequest(request_id=request_id, kind="completion", model="m", prompt_token_ids=PROMPT,
                           sampling=SamplingParams(max_tokens=8), stop_strings=(), stream=True, include_usage=False,
                           echo=False, prompt_logprobs=False, kv_params=None, return_token_ids=True)


def _export(request_id: str, num_tokens: int) -> ExportedRows:
    first = TokenEvent(request_id=request_id, token_id=9, logprob=-0.25, num_prompt_tokens=num_tokens)
    return ExportedRows(request_id=request_id, attn_row_ids=(3,), kda_row_ids=(4, 5), num_tokens=num_tokens,
                        first=first, generation=7)


async def _events(items):
    for item in items:
        yield item


async def _collect(moves: Moves, runtime, request_id: str, items) -> list:
    return [e async for e in moves.watch(runtime, _prepared(request_id), _events(items))]


def test_an_export_becomes_the_failure_that_carries_its_lease() -> None:
    moves, runtime = _moves()
    tokens = [TokenEvent(request_id="r", token_id=t, index=i, logprob=-1.0) for i, t in enumerate((11, 12))]
    out = asyncio.run(_collect(moves, runtime, "r", [*tokens, _export("r", len(PROMPT) + 2)]))
    failure = out[-1]
    assert isinstance(failure, EngineFailure) and failure.status == 503
    params = failure.kv_transfer_params
    assert params["transfer_mode"] == "move" and params["remote_num_tokens"] == len(PROMPT) + 2
    assert params["prompt_digest"] == prompt_digest([*PROMPT, 11, 12])  # the reader's prompt: + resume_token_ids
    assert params["first_token_id"] == 9 and math.isclose(params["first_token_logprob"], -0.25)
    assert params["remote_block_ids"] == [[3]] and params["remote_kda_block_ids"] == [4, 5]
    assert moves.num_outstanding == 1 and moves.holds("r")
    assert runtime.metrics.streams_moved.labels(outcome="leased")._value.get() == 1


def test_a_moved_streams_lease_is_claimed_only_by_the_instance_the_router_binds() -> None:
    """Any peer decode node holding the params could claim a move lease once; now none can before the router's
    bind (its choice of the next instance), and only that instance after it."""
    moves, runtime = _moves()
    out = asyncio.run(_collect(moves, runtime, "r", [_export("r", len(PROMPT))]))
    lease_id = out[-1].kv_transfer_params["lease_id"]
    exporter = moves.exporter
    with pytest.raises(ClaimRefused, match="not bound") as refused:
        exporter.claim(lease_id, "peer-decode")
    assert refused.value.status == 403
    exporter.bind(lease_id, "chosen-decode")
    with pytest.raises(ClaimRefused, match="another decode instance"):
        exporter.claim(lease_id, "peer-decode")
    exporter.claim(lease_id, "chosen-decode")


def test_an_export_that_does_not_match_the_stream_is_released() -> None:
    moves, runtime = _moves()
    out = asyncio.run(_collect(moves, runtime, "r", [_export("r", len(PROMPT) + 5)]))
    assert isinstance(out[-1], EngineFailure) and out[-1].kv_transfer_params is None
    assert out[-1].error == DRAIN_MESSAGE
    assert Release(request_id="r", generation=7) in runtime.executor.commands
    assert moves.num_outstanding == 0


def test_the_hand_off_moves_the_streams_and_ends_only_the_others() -> None:
    moves, runtime = _moves()

    async def run() -> None:
        gate = asyncio.Event()

        async def stream():
            yield TokenEvent(request_id="a", token_id=11, index=0, logprob=-1.0)
            await gate.wait()
            yield _export("a", len(PROMPT) + 1)
            await asyncio.sleep(3600)  # the executor's entry outlives the export for a moment

        watched = moves.watch(runtime, _prepared("a"), stream())
        await watched.__anext__()
        moves.hand_off(runtime)
        assert runtime.executor.commands == [MoveOut(request_id="a")]
        gate.set()
        moved = await watched.__anext__()
        assert moved.kv_transfer_params is not None
        for _ in range(50):
            await asyncio.sleep(0.02)
            if runtime.executor.ended_keep:
                break
        assert runtime.executor.ended_keep == [frozenset({"a"})]  # the moved stream is not ended again
        await watched.aclose()
        assert not moves.moved
    asyncio.run(run())


def test_an_import_whose_kv_is_arriving_at_the_hand_off_moves_once_it_streams() -> None:
    """The import reached the ranks (`import_may_start`) before the SIGTERM: the engine gets its `MoveOut` at once
    (it keeps it until the first decode step after the READs) and its stream, started later, ends with the lease."""
    moves, runtime = _moves()

    async def run() -> list:
        moves.admitted.add("i")
        moves.import_may_start("i")
        moves.admitted.discard("i")  # admission done; the stream has not started yet
        moves.hand_off(runtime)
        assert runtime.executor.commands == [MoveOut(request_id="i")] and moves.moving == {"i"}
        first = TokenEvent(request_id="i", token_id=11, index=0, logprob=-1.0)
        return await _collect(moves, runtime, "i", [first, _export("i", len(PROMPT) + 1)])
    out = asyncio.run(run())
    assert out[-1].kv_transfer_params is not None and out[-1].kv_transfer_params["remote_num_tokens"] == 4
    assert runtime.metrics.streams_moved.labels(outcome="leased")._value.get() == 1
    assert not moves.imported and not moves.moving


def test_an_import_that_had_not_reached_the_ranks_is_handed_back() -> None:
    """Queued for rows or still claiming its lease at the SIGTERM: it never starts here (a plain 503, which the router
    answers by placing it again: router/proxy.py), and the hand-off sends it no MoveOut."""
    moves, runtime = _moves()

    async def run() -> None:
        moves.admitted.add("q")
        moves.hand_off(runtime)
        assert runtime.executor.commands == [] and not moves.moving
        with pytest.raises(HandedBack) as refused:
            moves.import_may_start("q")
        assert refused.value.status == 503 and refused.value.message == DRAIN_MESSAGE
        with pytest.raises(HandedBack):
            moves.refuse_if_handing_off()  # what the import queue's wait checks at every turn
        assert "q" not in moves.imported
    asyncio.run(run())


def test_a_stream_that_starts_after_the_hand_off_is_handed_back_unstarted() -> None:
    """A colocated request whose events had not started (no Submit yet) when the hand-off came: a 503 failure, and
    its events are never started, so nothing is prefilled on the draining node."""
    moves, runtime = _moves()
    started: list[str] = []

    async def never_started():
        started.append("submitted")
        yield TokenEvent(request_id="late", token_id=11, index=0, logprob=-1.0)

    async def run() -> list:
        moves.hand_off(runtime)
        return [e async for e in moves.watch(runtime, _prepared("late"), never_started())]
    out = asyncio.run(run())
    assert len(out) == 1 and isinstance(out[0], EngineFailure) and out[0].status == 503
    assert out[0].kv_transfer_params is None and out[0].error == DRAIN_MESSAGE
    assert started == [] and "late" not in moves.movable
    assert runtime.metrics.streams_moved.labels(outcome="handed_back")._value.get() == 1
