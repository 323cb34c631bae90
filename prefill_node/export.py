"""The remote-decode path of the prefill node: prefill, keep the rows under a lease, answer vLLM-style.

Request (router -> P): the client body with `max_tokens=1`, `stream=false` and
`kv_transfer_params={"do_remote_decode": true, ...}`. Response: vLLM's completion body with one token and
`kv_transfer_params` = {do_remote_prefill: true, remote_engine_id, remote_request_id, remote_block_ids,
remote_host, remote_port, tp_size, dcp_size, remote_num_tokens, ...} plus the packed-row fields (block size,
layout fingerprint, KDA row ids, first token id, lease id and expiry).
The rows stay allocated under a lease (prefill_node/exports.py) until the reader's notification, an abort, or
lease expiry ends it; an abort that lands before the lease is granted makes the grant fail (499).
"""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api import EngineFailure, ExportedRows, Submit
from node.app import NodeRuntime, until_disconnect
from node.metrics import RequestTiming
from node.responses import final_response
from node.textgen import GenerationResult, PreparedRequest
from serving.errors import APIError


def check_export_request(prepared: PreparedRequest) -> None:
    if prepared.sampling.max_tokens != 1:
        raise APIError(400, f"a do_remote_decode request must have max_tokens=1, got {prepared.sampling.max_tokens}",
                       "max_tokens")
    if prepared.stream:
        raise APIError(400, "a do_remote_decode request cannot stream (send stream=false)", "stream")


async def _run_export(runtime: NodeRuntime, prepared: PreparedRequest) -> ExportedRows:
    cmd = Submit(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                 sampling=prepared.sampling, export=True, session=prepared.session)
    async for event in runtime.executor.events(cmd):
        if isinstance(event, EngineFailure):
            raise APIError(event.status, event.error)
        if isinstance(event, ExportedRows):
            return event
    raise APIError(500, "the engine ended the export without rows")


async def serve_export(runtime: NodeRuntime, prepared: PreparedRequest, request: Request) -> Response:
    """Prefill for a remote decoder and answer with the transfer params."""
    check_export_request(prepared)
    started = time.monotonic()
    exports = runtime.extras["exports"]
    exports.begin(prepared.request_id)
    try:
        exported: ExportedRows = await until_disconnect(request, _run_export(runtime, prepared))
        params = exports.grant(prepared.request_id, exported, prepared.prompt_token_ids)  # refused if aborted first
    finally:
        exports.forget(prepared.request_id)
    elapsed = time.monotonic() - started
    first = dataclasses.replace(exported.first, request_id=prepared.request_id)
    result = GenerationResult(tokens=[first], text=runtime.tokenizer.decode([int(exported.first.token_id or 0)]),
                              finish_reason="length", num_cached_tokens=exported.num_cached_tokens)
    runtime.metrics.observe_request(RequestTiming(num_prompt_tokens=len(prepared.prompt_token_ids),
                                                  num_output_tokens=1, finish_reason="length", e2e=elapsed,
                                                  ttft=elapsed))
    return JSONResponse(final_response(prepared, result, runtime.tokenizer, params.to_wire()).model_dump())
