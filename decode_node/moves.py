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
   `transfer_mode="move"`, bound to the prompt + the tokens the client has, awaiting its reader) and ends the
   stream with a 503 error event carrying the signed `kv_transfer_params` (node/textgen.py `StreamMoved`);
4. the router (router/moves.py) picks the next decode instance, binds the lease to it (the side channel's signed
   `POST /kv/leases/{id}/bind`: no other reader can claim it, and none at all before), and sends it the request
   with `resume_token_ids` and those params; it claims the lease on this node's side channel and READs the rows like a P -> D hand-off
   (decode_node/importer.py; this node must be one of its `prefill_peers`); their DONE notices end the lease,
   which frees the rows here; the node exits once no request and no lease is left (`num_outstanding`).
By state at the hand-off (docs/ARCHITECTURE.md, "Moving a stream"): a stream queued, prefilling or importing its
KV (its `ImportKV` reached the ranks: `imported`) moves at its first decode step; an import that has not reached the
ranks (`admitted`: in the import queue, or claiming its lease) and a stream that had not started are handed back
(`HandedBack`, a plain 503 that the router answers by placing the request elsewhere), so the draining node computes
nothing new. Failures: a stream that does not reach a decode step within `move_wait_s` ends with a plain 503 (the
router recomputes it elsewhere) and is aborted here; a move the router cannot place, or whose reader fails, falls
back to that recompute on the router's side; the lease then expires (`move_lease_s`) and the rows are quarantined
for the read timeout.
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


class HandedBack(APIError):
    """A request a draining node gives back before computing anything for it: a plain 503 (no Retry-After), which
    the router answers by placing the request again elsewhere (router/proxy.py: a decode 5xx)."""


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
    admitted: set[str] = field(default_factory=set)
    """Imports admitted here (decode_node/importer.py `serve_remote`) whose stream has not started yet."""
    imported: set[str] = field(default_factory=set)
    """Of `admitted`, those whose `ImportKV` the ranks have (their KV is arriving or arrived)."""
    is_handing_off: bool = False
    """The drain's hand-off began: no import starts here any more, and no stream starts that is not moving."""

    def can_move(self, prepared: PreparedRequest) -> bool:
        return self.exporter is not None and prepared.stream and prepared.return_token_ids

    async def watch(self, runtime: NodeRuntime, prepared: PreparedRequest,
                    events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The stream's events, its export (after `MoveOut`) turned into the failure that carries its lease."""
        request_id = prepared.request_id
        outputs: list[int] = []
        self.admitted.discard(request_id)
        self.imported.discard(request_id)
        if self.is_handing_off and request_id not in self.moving:  # nothing computed here yet: the router re-places it
            await events.aclose()  # type: ignore[attr-defined]
            runtime.metrics.streams_moved.labels(outcome="handed_back").inc()
            yield EngineFailure(request_id=request_id, error=DRAIN_MESSAGE, status=503)
            return
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
            params = self.exporter.grant(request_id, exported, tokens, transfer_mode="move", awaits_reader=True)
        except APIError:  # aborted meanwhile: the ranks' Abort ended the export
            return EngineFailure(request_id=request_id, error=DRAIN_MESSAGE, status=503)
        self.moved.add(request_id)
        runtime.metrics.streams_moved.labels(outcome="leased").inc()
        return EngineFailure(request_id=request_id, error=MOVED_MESSAGE, status=503,
                             kv_transfer_params=params.to_wire())

    def forget(self, request_id: str) -> None:
        """An import that ended before its stream started (handed back, shed, failed): nothing here to move."""
        self.admitted.discard(request_id)
        self.imported.discard(request_id)
        self.moving.discard(request_id)

    def refuse_if_handing_off(self) -> None:
        """Once the hand-off began, an import that holds no rows here is handed back (`HandedBack`)."""
        if self.is_handing_off:
            raise HandedBack(503, DRAIN_MESSAGE)

    def import_may_start(self, request_id: str) -> None:
        """Called right before an import's `ImportKV` goes to the ranks (no await between): handed back once the
        hand-off began, else marked as the ranks' (`imported`: a hand-off from now on moves it)."""
        self.refuse_if_handing_off()
        self.imported.add(request_id)

    def hand_off(self, runtime: NodeRuntime) -> None:
        """Move every movable stream, then end the rest (on the event loop; node/serving.py's drain calls it).
        Imports whose KV is arriving move too, at their first decode step after it arrived (the engine keeps the
        `MoveOut`); imports that have not reached the ranks are handed back (`import_may_start`)."""
        self.is_handing_off = True
        streaming, importing = sorted(self.movable), sorted(self.imported - self.movable)
        ids = streaming + importing
        for request_id in ids:
            runtime.executor.submit(MoveOut(request_id=request_id))
        self.moving.update(ids)
        num_back = len(self.admitted - self.imported)
        log.warning("draining: moving %d stream(s) with their KV (%d of them at their import: moving once it is read, "
                    "handed back if it finds no rows); %d import(s) not started yet handed back", len(ids),
                    len(importing), num_back)
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
