"""Serving an export request (router -> the node that holds or computes a prompt's rows): prefill the prompt and
answer with signed transfer params, the rows kept under a lease for one reader.

Both node kinds serve it: a prefill node for every P leg (prefill_node/app.py), a TP decode node for a session that
outgrows its pool (decode_node/app.py: the new pool's instance READs the session's rows from it instead of
prefilling the whole context again; its prefix cache holds the session, so only the new turn's tokens are
computed here). The request is the client body with `max_tokens=1`, `stream=false` and
`kv_transfer_params={"do_remote_decode": true, ...}`; it runs as a `Submit(export=True)`, whose rows stay allocated,
and the answer is vLLM's completion body with one token and `kv_transfer_params` = {do_remote_prefill: true,
remote_engine_id, remote_request_id, remote_block_ids, remote_host, remote_port, tp_size, dcp_size,
remote_num_tokens, ...} plus the packed-row fields (block size, layout fingerprint, KDA row ids, first token id,
lease id and expiry, prompt digest), signed with the cluster secret; `usage.prompt_tokens_details.cached_tokens` is
what the prefix cache spared.
The lease itself (grant, claims, notifications, release) is the node package's `kv_transfer.exporter.Exporter`;
node/ sees it only as `ExportLeases` (node/ holds neither half of a hand-off: tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api import Abort, EngineFailure, ExportedRows, Submit
from kv_transfer.params import KVTransferParams
from kv_transfer.signing import ENGINE_ID_PATTERN
from node.app import until_disconnect
from node.metrics import RequestTiming
from node.responses import final_response
from node.runtime import NodeRuntime
from node.textgen import GenerationResult, PreparedRequest
from serving.errors import APIError

__all__ = ["ExportLeases", "check_export_request", "serve_export"]


class ExportLeases(Protocol):
    """What serving an export needs of the node's lease owner (kv_transfer/exporter.py `Exporter`)."""

    def begin(self, request_id: str) -> None: ...

    def grant(self, request_id: str, exported: ExportedRows, token_ids: list[int], reader: str | None = None,
              transfer_mode: str = "pull") -> KVTransferParams: ...

    def forget(self, request_id: str) -> None: ...

    @property
    def require_reader(self) -> bool:
        """Every export request must name its reader (node setting `require_reader`)."""
        ...


def check_export_request(prepared: PreparedRequest, require_reader: bool = False) -> str | None:
    """Refuse an export request this node cannot serve; the decode engine it names as the reader, if any
    (`require_reader`: one must be named)."""
    reader = prepared.kv_params.decode_engine_id if prepared.kv_params is not None else None
    if reader is not None and not ENGINE_ID_PATTERN.fullmatch(reader):
        raise APIError(400, "kv_transfer_params.decode_engine_id is not an engine id", "kv_transfer_params")
    if reader is None and require_reader:
        raise APIError(400, "kv_transfer_params.decode_engine_id is required: this node issues hand-offs bound to "
                            "one decode instance only (require_reader)", "kv_transfer_params")
    if prepared.sampling.max_tokens != 1:
        raise APIError(400, f"a do_remote_decode request must have max_tokens=1, got {prepared.sampling.max_tokens}",
                       "max_tokens")
    if prepared.stream:
        raise APIError(400, "a do_remote_decode request cannot stream (send stream=false)", "stream")
    return reader


async def _run_export(runtime: NodeRuntime, prepared: PreparedRequest) -> ExportedRows:
    cmd = Submit(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                 sampling=prepared.sampling, export=True, session=prepared.session,
                 cache_salt=prepared.cache_salt)
    # leaving before the rows came back leaves no lease (only `grant` makes one), so no reader: free them at once
    async for event in runtime.executor.events(cmd, on_leave=Abort(prepared.request_id, reads_done=True)):
        if isinstance(event, EngineFailure):
            raise APIError(event.status, event.error)
        if isinstance(event, ExportedRows):
            return event
    raise APIError(500, "the engine ended the export without rows")


async def serve_export(runtime: NodeRuntime, leases: ExportLeases, prepared: PreparedRequest, request: Request,
                       transfer_mode: str = "pull") -> Response:
    """Prefill for a remote decoder and answer with the transfer params (`transfer_mode`: "pull" for a P leg,
    "move" for a session's rows leaving a decode instance)."""
    reader = check_export_request(prepared, leases.require_reader)
    started = time.monotonic()
    leases.begin(prepared.request_id)
    try:
        exported: ExportedRows = await until_disconnect(request, _run_export(runtime, prepared))
        params = leases.grant(prepared.request_id, exported, prepared.prompt_token_ids, reader,  # refused if aborted
                              transfer_mode=transfer_mode)
    finally:
        leases.forget(prepared.request_id)
    elapsed = time.monotonic() - started
    first = dataclasses.replace(exported.first, request_id=prepared.request_id)
    result = GenerationResult(tokens=[first], text=runtime.tokenizer.decode([int(exported.first.token_id or 0)]),
                              finish_reason="length", num_cached_tokens=exported.num_cached_tokens)
    runtime.metrics.observe_request(RequestTiming(num_prompt_tokens=len(prepared.prompt_token_ids),
                                                  num_output_tokens=1, finish_reason="length", e2e=elapsed,
                                                  ttft=elapsed))
    return JSONResponse(final_response(prepared, result, runtime.tokenizer, params.to_wire()).model_dump())
