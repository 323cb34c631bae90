"""Serve a request from the node's own engine (colocated prefill + decode), streaming or not.

Also the generic "events -> HTTP response" glue that the decode node reuses after a KV import.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api import Submit
from node.app import streaming, until_disconnect
from node.responses import final_response, stream_chunks
from node.runtime import NodeRuntime
from node.textgen import GenerationResult, Piece, PreparedRequest, StreamMoved, generate_pieces
from serving.errors import APIError, error_body


async def _record(runtime: NodeRuntime, result: GenerationResult) -> None:
    if result.timing is not None:
        runtime.metrics.observe_request(result.timing)


def respond(runtime: NodeRuntime, prepared: PreparedRequest, request: Request, events: AsyncIterator[Any],
            started: float, kv_params: dict | None = None, cached_tokens: int = 0) -> Any:
    """Consume `events` into a streaming or JSON response (awaitable for JSON, StreamingResponse else)."""
    result = GenerationResult(num_cached_tokens=cached_tokens)
    pieces = generate_pieces(events, prepared, runtime.tokenizer, result, started)
    if prepared.stream:
        async def chunks() -> AsyncIterator[Any]:
            try:
                async for chunk in stream_chunks(prepared, pieces, result, runtime.tokenizer):
                    yield chunk
            except APIError as exc:  # headers are gone: report in-band, as vLLM does
                body = error_body(exc.status, exc.message, exc.param)
                if isinstance(exc, StreamMoved):  # the router continues the stream on another instance
                    body["kv_transfer_params"] = exc.kv_transfer_params
                yield json.dumps(body)
            finally:
                await pieces.aclose()
                await _record(runtime, result)
        return streaming(chunks())

    async def collect() -> Response:
        try:
            async for _ in pieces:
                pass
        finally:
            await pieces.aclose()
            await _record(runtime, result)
        body = final_response(prepared, result, runtime.tokenizer, kv_params)
        return JSONResponse(body.model_dump())
    return until_disconnect(request, collect())


async def serve_local(runtime: NodeRuntime, prepared: PreparedRequest, request: Request,
                      watch: Callable[[AsyncIterator[Any]], AsyncIterator[Any]] | None = None) -> Response:
    """Prefill and decode on this node; `watch` wraps the request's events (the decode node's moves on drain)."""
    started = time.monotonic()
    cmd = Submit(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                 sampling=prepared.sampling, session=prepared.session, cache_salt=prepared.cache_salt)
    events = runtime.executor.events(cmd)
    out = respond(runtime, prepared, request, watch(events) if watch is not None else events, started)
    return out if prepared.stream else await out


__all__ = ["serve_local", "respond", "Piece"]
