"""The prefill node's exporter: the one owner of a hand-off on the prefill side - export, lease, notifications,
release.

Export (`serve_export`, router -> P): the client body with `max_tokens=1`, `stream=false` and
`kv_transfer_params={"do_remote_decode": true, ...}` is prefilled as a `Submit(export=True)`; the rows stay
allocated and the answer is vLLM's completion body with one token and `kv_transfer_params` = {do_remote_prefill:
true, remote_engine_id, remote_request_id, remote_block_ids, remote_host, remote_port, tp_size, dcp_size,
remote_num_tokens, ...} plus the packed-row fields (block size, layout fingerprint, KDA row ids, first token id,
lease id and expiry, prompt digest), signed with the cluster secret.
Lease, exposure and notifications: `Exporter` (kv_transfer/exporter.py, shared with the decode node's moves) turns
the engine's export into signed params under a lease, which ends by the readers' DONE, an abort or expiry.
"""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api import Abort, EngineFailure, ExportedRows, Submit
from kv_transfer.exporter import Exporter, ExportIdentity
from kv_transfer.signing import ENGINE_ID_PATTERN
from node.app import until_disconnect
from node.metrics import RequestTiming
from node.responses import final_response
from node.runtime import NodeRuntime
from node.textgen import GenerationResult, PreparedRequest
from serving.errors import APIError

__all__ = ["Exporter", "ExportIdentity", "check_export_request", "serve_export"]


def check_export_request(prepared: PreparedRequest) -> str | None:
    """Refuse an export request this node cannot serve; the decode engine it names as the reader, if any."""
    reader = prepared.kv_params.decode_engine_id if prepared.kv_params is not None else None
    if reader is not None and not ENGINE_ID_PATTERN.fullmatch(reader):
        raise APIError(400, "kv_transfer_params.decode_engine_id is not an engine id", "kv_transfer_params")
    if prepared.sampling.max_tokens != 1:
        raise APIError(400, f"a do_remote_decode request must have max_tokens=1, got {prepared.sampling.max_tokens}",
                       "max_tokens")
    if prepared.stream:
        raise APIError(400, "a do_remote_decode request cannot stream (send stream=false)", "stream")
    return reader


async def _run_export(runtime: NodeRuntime[Exporter], prepared: PreparedRequest) -> ExportedRows:
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


async def serve_export(runtime: NodeRuntime[Exporter], prepared: PreparedRequest, request: Request) -> Response:
    """Prefill for a remote decoder and answer with the transfer params."""
    reader = check_export_request(prepared)
    started = time.monotonic()
    exporter = runtime.handoff
    exporter.begin(prepared.request_id)
    try:
        exported: ExportedRows = await until_disconnect(request, _run_export(runtime, prepared))
        params = exporter.grant(prepared.request_id, exported, prepared.prompt_token_ids, reader)  # refused if aborted
    finally:
        exporter.forget(prepared.request_id)
    elapsed = time.monotonic() - started
    first = dataclasses.replace(exported.first, request_id=prepared.request_id)
    result = GenerationResult(tokens=[first], text=runtime.tokenizer.decode([int(exported.first.token_id or 0)]),
                              finish_reason="length", num_cached_tokens=exported.num_cached_tokens)
    runtime.metrics.observe_request(RequestTiming(num_prompt_tokens=len(prepared.prompt_token_ids),
                                                  num_output_tokens=1, finish_reason="length", e2e=elapsed,
                                                  ttft=elapsed))
    return JSONResponse(final_response(prepared, result, runtime.tokenizer, params.to_wire()).model_dump())
