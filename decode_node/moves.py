"""Planned moves out of a draining decode node: each running stream's KV goes to another decode instance with NIXL
READs, and the stream continues there from its next token (docs/ARCHITECTURE.md, "Moving a stream").

On SIGTERM with `drain_hand_off_s` (node/serving.py calls the app's hand-off), `Moves.hand_off`:
1. sends `MoveOut` for every stream that can move (`movable`: a stream that asked for token ids, which our router's
   resumable streams do, on a node whose rows a reader can remap: not a DCP pool); the engine's next decode
   step writes the KV of the stream's last token, samples the next token without streaming it and exports the
   request (`ExportedRows`: prompt + outputs so far, that token first; engine/engine.py `_move_out`);
2. each rank's `RankExporter` (kv_transfer/rank_exporter.py, inside decode_node/rank_importer.py) exposes exactly
   those rows to its transport, as a prefill rank does;
3. `watch` (around the stream's events) turns the export into a lease (kv_transfer/exporter.py `Exporter.grant`,
   `transfer_mode="move"`, bound to the prompt + the tokens the client has) and ends the stream with a 503
   error event carrying the signed `kv_transfer_params` (node/textgen.py `StreamMoved`);
4. the router (router/moves.py) sends the request with `resume_token_ids` and those params to another decode
   instance, which claims the lease on this node's side channel and READs the rows like a P -> D hand-off
   (decode_node/importer.py; this node must be one of its `prefill_peers`); their DONE notices end the lease,
   which frees the rows here; the node exits once no request and no lease is left (`num_outstanding`).
Failures: a stream that is not decoding yet when the hand-off comes (queued, prefilling, importing) moves at its
first decode step; one that does not reach it within `move_wait_s` ends with a plain 503 (the router recomputes it
elsewhere) and is aborted here; a move the router cannot place, or whose reader fails, falls back to that
recompute on the router's side; the lease then expires (`move_lease_s`) and the rows are quarantined for the read
timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.api import EngineFailure, ExportedRows, MoveOut, Release, TokenEvent
from kv_transfer.exporter import Exporter
from node.runtime import NodeRuntime
from node.textgen import PreparedRequest
from serving.errors import APIError

log = logging.getLogger(__name__)

DRAIN_MESSAGE = "the node is draining: continue on another instance"
MOVED_MESSAGE = "the node is draining: the stream moves to another instance with its KV"


@dataclass
class Moves:
    """The streams a decode node may move out, and the leases on those it moved (see the module docstring)."""

    exporter: Exporter | None
    """Leases on moved streams' rows; None where this node moves nothing (a DCP pool, no transport, disabled)."""
    wait_s: float = 10.0
    movable: set[str] = field(default_factory=set)
    """Internal ids of the streams running here that may move."""
    moving: set[str] = field(default_factory=set)
    """Streams sent `MoveOut` whose export has not come back yet."""
    moved: set[str] = field(default_factory=set)
    """Streams leased to another instance (their stream is ending: the hand-off must not end them again)."""

    def can_move(self, prepared: PreparedRequest) -> bool:
        return self.exporter is not None and prepared.stream and prepared.return_token_ids

    async def watch(self, runtime: NodeRuntime, prepared: PreparedRequest,
                    events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The stream's events, its export (after `MoveOut`) turned into the failure that carries its lease."""
        request_id = prepared.request_id
        outputs: list[int] = []
        if self.can_move(prepared):
            self.movable.add(request_id)
        try:
            async for event in events:
                if isinstance(event, TokenEvent) and event.token_id is not None and event.finish_reason != "abort":
                    outputs.append(int(event.token_id))
                elif isinstance(event, ExportedRows):
                    event = self._moved(runtime, prepared, event, outputs)
                yield event
        finally:
            self.movable.discard(request_id)
            self.moving.discard(request_id)
            await events.aclose()  # type: ignore[attr-defined]
            self.moved.discard(request_id)  # after: the executor no longer names it

    def _moved(self, runtime: NodeRuntime, prepared: PreparedRequest, exported: ExportedRows,
               outputs: list[int]) -> EngineFailure:
        """Lease the moved stream's rows to the next decode instance (bound to prompt + the tokens sent)."""
        request_id = prepared.request_id
        self.moving.discard(request_id)
        tokens = [*prepared.prompt_token_ids, *outputs]
        if self.exporter is None or len(tokens) != exported.num_tokens:
            log.warning("stream %s exported %d tokens, %d streamed: recomputed instead", request_id,
                        exported.num_tokens, len(tokens))
            runtime.executor.submit(Release(request_id=request_id, generation=exported.generation))
            return EngineFailure(request_id=request_id, error=DRAIN_MESSAGE, status=503)
        try:
            params = self.exporter.grant(request_id, exported, tokens, transfer_mode="move")
        except APIError:  # aborted meanwhile: the ranks' Abort ended the export
            return EngineFailure(request_id=request_id, error=DRAIN_MESSAGE, status=503)
        self.moved.add(request_id)
        runtime.metrics.streams_moved.labels(outcome="leased").inc()
        return EngineFailure(request_id=request_id, error=MOVED_MESSAGE, status=503,
                             kv_transfer_params=params.to_wire())

    def hand_off(self, runtime: NodeRuntime) -> None:
        """Move every movable stream, then end the rest (on the event loop; node/serving.py's drain calls it)."""
        ids = sorted(self.movable)
        for request_id in ids:
            runtime.executor.submit(MoveOut(request_id=request_id))
        self.moving.update(ids)
        log.warning("draining: moving %d stream(s) with their KV", len(ids))
        asyncio.get_running_loop().create_task(self._end_the_rest(runtime))

    async def _end_the_rest(self, runtime: NodeRuntime) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.moving and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stuck = sorted(self.moving)
        num = runtime.executor.end_all(DRAIN_MESSAGE, status=503, keep=frozenset(self.moved))
        for request_id in stuck:  # a late export would wait for a lease that never comes: end it on the ranks
            runtime.executor.abort(request_id)
        if num or stuck:
            runtime.metrics.streams_moved.labels(outcome="recomputed").inc(num)
            log.warning("draining: handed off %d request(s) to be recomputed (%d did not reach a step)", num,
                        len(stuck))

    def holds(self, request_id: str) -> bool:
        return self.exporter is not None and self.exporter.holds(request_id)

    @property
    def num_outstanding(self) -> int:
        return self.exporter.num_outstanding if self.exporter is not None else 0
