"""The decode node's importer: the one owner of a hand-off on the decode side - admit, read, hand the rows to the
engine. `serve_remote` checks the prefill node's params, has the rows read over the transport (every rank reads its
own share, one READ per source rank, remapped: decode_node/rank_importer.py; the DONE notifications tell the
prefill node), then decodes from the imported rows (`StartDecode`) and answers as a normal (streaming or JSON)
completion. `Importer` holds what admission uses: the hand-off gate, the peer directory, the import queue, this
node's geometry and the KV-load failure policy.

Failures before admission are 4xx answers that touch no memory: first the hand-off gate (decode_node/handoff.py:
signature, ids, prompt, reader, replay here; 403 before any connection), then the peer directory
(decode_node/peers.py: the address comes from the node's configured peers, 403 for an engine that is not one of
them), then the claim at the prefill node (the one authority that a lease is redeemed once: 409 when another
presentation, here or on another decode node, claimed it first; 403 when it was issued for another reader), then
malformed params, unknown engine, expired lease, geometry mismatch; the prefill node is told to release its rows
once the lease is ours (claimed) to end. An import short of rows waits in the bounded queue of decode_node/admission.py (503 with
Retry-After when it cannot get them in time), never a 502.
`check_readable` runs here, once per import (the ranks plan and post without checking again).
The import itself is asynchronous on the ranks (decode_node/rank_importer.py): this handler awaits the merged
outcome while other streams keep decoding. A failed read follows `kv_load_failure_policy`: `fail` answers 502 and
frees the rows on both sides, `recompute` prefills locally; the prefill node is told to release its rows only when
every READ was cancelled (an uncancelled one leaves both sides' rows quarantined: P's lease expires, D holds its rows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import httpx
from fastapi import Request
from fastapi.responses import Response

from decode_node.admission import ImportQueue, is_short_of_rows
from decode_node.handoff import HandoffGate
from decode_node.moves import DRAIN_MESSAGE, HandedBack, Moves
from decode_node.peers import Address, PeerDirectory
from engine.api import HandOffAbort, ImportKV, ImportOutcome, StartDecode
from kv_transfer.geometry import Geometry
from kv_transfer.params import KVParamsError, KVTransferParams, check_readable
from kv_transfer.remap import pair_problems
from kv_transfer.side_channel import InstanceMetadata
from kv_transfer.signing import lease_key
from node.app import NodeBusy, until_disconnect
from node.local import respond, serve_local
from node.runtime import NodeRuntime
from node.textgen import PreparedRequest
from serving.errors import APIError

log = logging.getLogger(__name__)

KV_TRANSFER_HEADER = "X-KV-Transfer-Seconds"
"""Seconds the KV READs of an imported request took (the router observes them as its `kv_transfer` leg)."""


@dataclass
class Importer:
    """The decode node's hand-off owner (see the module docstring); built once its ranks reported their layout."""

    gate: HandoffGate
    peers: PeerDirectory
    queue: ImportQueue
    geometry: Geometry
    """This node's pairing geometry (world size, DCP size, block size, layout fingerprint)."""
    policy: Literal["fail", "recompute"] = "recompute"
    """A failed KV read: `fail` answers 502 (rows released on both sides), `recompute` prefills here."""
    moves: Moves = field(default_factory=lambda: Moves(None))
    """The streams this node moves out on drain, and the leases on their rows (decode_node/moves.py)."""

    def holds(self, request_id: str) -> bool:
        return self.moves.holds(request_id)  # an import's rows belong to its request, in flight while they do

    def abort(self, request_id: str, in_flight: Iterable[str] = ()) -> HandOffAbort:
        """A moved stream's lease ends (the ranks' Abort cancels an import's READs: decode_node/rank_importer.py;
        until then they may write, so the rows go to quarantine either way)."""
        exporter = self.moves.exporter
        ended = exporter is not None and exporter.abort(request_id, in_flight).ended
        return HandOffAbort(ended=ended, reads_done=False)

    @property
    def num_outstanding(self) -> int:
        return self.moves.num_outstanding


def _check_request(prepared: PreparedRequest, params: KVTransferParams) -> None:
    """The checks of the params against the request alone (no peer asked); raises APIError 400 naming the problem."""
    if params.first_token_id is None:
        raise APIError(400, "kv_transfer_params: first_token_id is missing", "kv_transfer_params")
    if params.remote_num_tokens != len(prepared.prompt_token_ids):
        raise APIError(400, f"kv_transfer_params: remote_num_tokens {params.remote_num_tokens} does not match the "
                            f"prompt's {len(prepared.prompt_token_ids)} tokens", "kv_transfer_params")


async def _admit(runtime: NodeRuntime[Importer], prepared: PreparedRequest, params: KVTransferParams,
                 address: Address) -> InstanceMetadata:
    """Every check against the prefill node's metadata before memory is touched; raises APIError (4xx) naming the
    problem."""
    try:
        info = await runtime.handoff.peers.get(address, params.remote_engine_id)
    except (httpx.HTTPError, ValueError) as exc:
        raise APIError(502, f"cannot reach the prefill node's side channel at {address[0]}:{address[1]}: "
                            f"{exc}") from exc
    try:
        check_readable(params, engine_id=info.engine_id, fingerprint=info.layout_fingerprint, num_rows=info.num_rows,
                       kda_groups=info.kda_groups, block_size=info.block_size)
    except KVParamsError as exc:
        raise APIError(400, f"kv_transfer_params: {exc}", "kv_transfer_params") from exc
    problems = pair_problems(Geometry(params.tp_size, params.dcp_size, params.block_size or 0,
                                       params.layout_fingerprint or ""), runtime.handoff.geometry)
    if (params.tp_size, params.dcp_size) != (info.tp_size, info.dcp_size):
        problems.append(f"params say prefill tp_size={params.tp_size} dcp_size={params.dcp_size}, the prefill node "
                        f"{info.engine_id} runs tp_size={info.tp_size} dcp_size={info.dcp_size}")
    if problems:
        raise APIError(400, f"kv_transfer_params: prefill geometry cannot feed this decode node: "
                            f"{'; '.join(problems)}", "kv_transfer_params")
    return info


async def serve_here(runtime: NodeRuntime[Importer], prepared: PreparedRequest, request: Request) -> Response:
    """Prefill and decode on this node (node/local.py), the stream movable on drain (decode_node/moves.py)."""
    return await serve_local(runtime, prepared, request,
                             lambda events: runtime.handoff.moves.watch(runtime, prepared, events))


async def _recompute_here(runtime: NodeRuntime[Importer], prepared: PreparedRequest, request: Request) -> Response:
    """The `recompute` policy after a failed import: prefill here, unless the drain's hand-off began (a draining node
    computes nothing new: a plain 503 hands the request back to the router, which places it elsewhere)."""
    if runtime.handoff.moves.is_handing_off:
        runtime.metrics.streams_moved.labels(outcome="handed_back").inc()
        raise HandedBack(503, DRAIN_MESSAGE)
    return await serve_here(runtime, prepared, request)


async def serve_remote(runtime: NodeRuntime[Importer], prepared: PreparedRequest, request: Request,
                       params: KVTransferParams) -> Response:
    """Import the prefill node's rows and decode."""
    started = time.monotonic()
    importer = runtime.handoff
    peers, gate, policy = importer.peers, importer.gate, importer.policy
    _check_request(prepared, params)
    gate.admit(params, prepared.prompt_token_ids)  # 403 before any connection or memory access; marks it used
    address = await peers.resolve(params)  # 403 for an engine that is not a peer of this node
    reader, claimed = gate.engine_id, False
    try:
        grant = await peers.claim(address, str(params.lease_id), reader)  # the prefill node: first claim wins
        claimed = True
        info = (await _admit(runtime, prepared, params, address)).for_lease(grant)  # the lease's rows, no others
    except APIError as exc:
        if claimed:  # ours to end: nothing was read
            await peers.release(address, params.lease_id, reader)
        if exc.status == 502 and policy == "recompute":  # the prefill node is unreachable: a KV load failure
            runtime.metrics.failed_transfers.inc()
            return await _recompute_here(runtime, prepared, request)
        raise
    first = params.first_token(prepared.request_id, len(prepared.prompt_token_ids))
    notify_key = b"" if gate.secret is None else lease_key(gate.secret, str(params.lease_id))
    cmd = ImportKV(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                   sampling=prepared.sampling, first=first, params=params, peer=info, session=prepared.session,
                   notify_key=notify_key, cache_salt=prepared.cache_salt)

    async def attempt() -> tuple[object, object]:
        importer.moves.import_may_start(prepared.request_id)  # a drain's hand-off began: 503, handed back
        events = runtime.executor.events(cmd)
        first = await events.__anext__()  # a disconnect cancels this inside the generator: it aborts
        if is_short_of_rows(first):  # nothing allocated: the ranks do not hold it (it queues)
            importer.moves.imported.discard(prepared.request_id)
        return first, events

    importer.moves.admitted.add(prepared.request_id)
    try:
        outcome, events = await until_disconnect(request, importer.queue.admit(
            runtime, attempt, params.lease_expiry, stop=importer.moves.refuse_if_handing_off))
    except (NodeBusy, HandedBack) as exc:
        importer.moves.forget(prepared.request_id)
        if isinstance(exc, HandedBack):
            runtime.metrics.streams_moved.labels(outcome="handed_back").inc()
        await peers.release(address, params.lease_id, reader)  # nothing was read: the rows go back at once
        raise
    except BaseException:
        importer.moves.forget(prepared.request_id)
        raise
    importer.moves.admitted.discard(prepared.request_id)
    if not isinstance(outcome, ImportOutcome) or outcome.error:
        importer.moves.forget(prepared.request_id)
        await events.aclose()
        runtime.executor.abort(prepared.request_id)
        runtime.metrics.failed_transfers.inc()
        if not (isinstance(outcome, ImportOutcome) and outcome.uncancelled):  # a READ may still run: let it expire
            await peers.release(address, params.lease_id, reader)
        reason = outcome.error if isinstance(outcome, ImportOutcome) else getattr(outcome, "error", "import failed")
        log.warning("request %s: the KV import of lease %s from %s failed (%s): %s", prepared.request_id,
                    params.lease_id, params.remote_engine_id, policy, reason)
        if policy == "recompute" or importer.moves.is_handing_off:  # draining: handed back, whatever the policy
            return await _recompute_here(runtime, prepared, request)
        raise APIError(502, f"KV transfer from {params.remote_engine_id} failed: {reason}")
    runtime.metrics.xfer_time.observe(outcome.seconds)
    runtime.metrics.xfer_bytes.observe(outcome.num_bytes)
    if params.transfer_mode == "move":  # a stream moved here from a draining decode instance
        runtime.metrics.kv_moved_bytes.inc(outcome.num_bytes)
        runtime.metrics.kv_moved_reads.inc()
    if outcome.num_descriptors:
        runtime.metrics.xfer_descs.observe(outcome.num_descriptors)
    for post_s in outcome.post_s:
        runtime.metrics.post_time.observe(post_s)
    runtime.executor.submit(StartDecode(request_id=prepared.request_id))
    # usage.cached_tokens: the prompt tokens this node already held and did not read (the engine's events carry them)
    out = respond(runtime, prepared, request, importer.moves.watch(runtime, prepared, events), started)
    response = out if prepared.stream else await out
    response.headers[KV_TRANSFER_HEADER] = f"{outcome.seconds:.6f}"  # the router's `kv_transfer` leg
    return response
