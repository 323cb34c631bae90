"""Fake upstream nodes for router logic tests: small FastAPI apps that speak vLLM's PD protocol.

`FakeNode` records every body and header it receives, answers a prefill request (kv_transfer_params
with do_remote_decode) with handoff params, and a decode request with deterministic tokens (stream or
not). Failure modes: `fail_status` (with `fail_headers`), `delay_s` before answering, `token_delay_s`
between streamed tokens, `drop_handoff`, `models_body` (a broken `/v1/models`). `MultiHostTransport`
routes httpx requests to in-process apps by host:port; hosts in its `refused` set fail to connect for
POSTs (a node whose health port answers while its serving path is unreachable).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeNode:
    name: str
    role: str
    block_size: int = 16
    engine_label: str | None = None
    tp_size: int | None = None
    model: str = MODEL
    fail_status: int | None = None
    fail_headers: dict[str, str] = field(default_factory=dict)
    """Headers of the `fail_status` answer (e.g. Retry-After for a shedding 503)."""
    delay_s: float = 0.0
    token_delay_s: float = 0.0
    num_tokens: int = 4
    token_pad: int = 0
    """Bytes of padding in every streamed token's text (a big stream to fill a client's buffers)."""
    stream_error_after: int | None = None
    """Streams end with an OpenAI error event and [DONE] after this many tokens (a node failing mid-stream)."""
    cut_after: int | None = None
    """Streams end without [DONE] after this many tokens (a node whose stream was cut)."""
    moved_params: dict | None = None
    """With `stream_error_after`: the error event is a draining node's move (503 with these kv_transfer_params,
    decode_node/moves.py)."""
    bind_status: int = 200
    """What POST /kv/leases/{id}/bind answers (the router binds a moved stream's lease to its next instance)."""
    binds: list[tuple[str, str]] = field(default_factory=list)
    """(lease id, reader) of every bind it was asked for."""
    refuse_moves: bool = False
    """Answer 403 to a decode leg whose kv_transfer_params are a move (a node that cannot read the mover's rows)."""
    drop_handoff: bool = False
    healthy: bool = True
    models_body: object = None
    """When set, what GET /v1/models answers instead of the model list (`[]`, garbage)."""
    weights: str | None = None
    """`weights_fingerprint` of the model card (reference nodes report one)."""
    root: str | None = None
    """`root` of the model card (vLLM: the model path)."""
    engine_id: str | None = None
    """When set, the node answers GET /v1/cache (an empty cache) naming this engine id, as reference nodes do
    (a node labelled "reference" gets `engine-<name>` unless `reports_engine_id` is False)."""
    reports_engine_id: bool = True
    blocks_cached: int = 0
    """Blocks its GET /v1/cache says it holds (above 0: its cache is on, so the router notes what turns leave)."""
    bodies: list[dict] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    produced_at: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    """`prompt_tokens_details.cached_tokens` of the answers' usage, one per answer (the last one repeats); none when
    empty."""

    def __post_init__(self) -> None:
        if self.engine_id is None and self.engine_label == "reference" and self.reports_engine_id:
            self.engine_id = f"engine-{self.name}"

    def usage(self, completion_tokens: int) -> dict:
        usage = {"prompt_tokens": 5, "completion_tokens": completion_tokens, "total_tokens": 5 + completion_tokens}
        if self.cached_tokens:
            cached = self.cached_tokens.pop(0) if len(self.cached_tokens) > 1 else self.cached_tokens[0]
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def metrics_text(self) -> str:
        labels = {"block_size": str(self.block_size), "cache_dtype": "auto", "num_gpu_blocks": "100", "engine": "0"}
        if self.engine_label:
            labels["engine"] = self.engine_label
            labels["layout_fingerprint"] = "fp-test"
        if self.tp_size:
            labels["tp_size"] = str(self.tp_size)
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return ("# TYPE vllm:cache_config_info gauge\n"
                f"vllm:cache_config_info{{{body}}} 1.0\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{self.model}"}} 0.0\n')

    def app(self) -> FastAPI:
        app = FastAPI()
        node = self

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if node.healthy else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(node.metrics_text(), media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> Response:
            if isinstance(node.models_body, bytes):
                return Response(node.models_body, media_type="application/json")
            if node.models_body is not None:
                return JSONResponse(node.models_body)
            card = {"id": node.model, "object": "model", "max_model_len": 4096}
            weights = node.weights or ("w-test" if node.engine_label == "reference" else None)
            if weights:
                card["weights_fingerprint"] = weights
            if node.root:
                card["root"] = node.root
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/v1/cache")
        async def cache() -> Response:
            if node.engine_id is None:
                return Response(status_code=404)
            return JSONResponse({"engine_id": node.engine_id, "block_tokens": node.block_size, "sessions": {},
                                 "blocks_cached": node.blocks_cached})

        @app.post("/kv/leases/{lease_id}/bind")
        async def bind(lease_id: str, request: Request) -> Response:
            node.binds.append((lease_id, (await request.json())["reader"]))
            return JSONResponse({"lease_id": lease_id, "alive": True}, status_code=node.bind_status)

        @app.post("/abort_requests")
        async def abort(request: Request) -> dict:
            node.aborted.extend((await request.json())["request_ids"])
            return {"aborted": True}

        async def generate(request: Request) -> Response:
            body = await request.json()
            rid = request.headers.get("x-request-id")
            node.bodies.append(body)
            node.request_ids.append(rid)
            if node.delay_s and not await node.wait_or_disconnect(request, rid):
                return Response(status_code=499)
            if node.fail_status:
                return JSONResponse({"error": {"message": "injected", "code": node.fail_status}},
                                    status_code=node.fail_status, headers=node.fail_headers)
            params = body.get("kv_transfer_params") or {}
            if node.refuse_moves and params.get("transfer_mode") == "move":
                return JSONResponse({"error": {"message": "not a peer", "code": 403}}, status_code=403)
            if params.get("do_remote_decode"):
                handoff = None if node.drop_handoff else {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                    "remote_engine_id": f"engine-{node.name}", "remote_request_id": f"p-{rid}",
                    "remote_host": "localhost", "remote_port": 5600, "tp_size": 1}
                if handoff is not None and params.get("decode_engine_id"):
                    handoff["decode_engine_id"] = params["decode_engine_id"]
                return JSONResponse({"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                     "usage": node.usage(1),
                                     "kv_transfer_params": handoff})
            chat = request.url.path.endswith("chat/completions")
            if body.get("stream"):
                return StreamingResponse(node.stream(rid, chat, body), media_type="text/event-stream")
            text = "".join(f"t{i} " for i in range(node.num_tokens))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            node.finished.append(rid)
            return JSONResponse({"id": "d", "choices": [{**choice, "finish_reason": "length"}],
                                 "usage": node.usage(node.num_tokens)})

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)
        return app

    async def wait_or_disconnect(self, request: Request, rid: str | None) -> bool:
        """Sleep `delay_s` unless the caller disconnects first (as vLLM aborts on disconnect)."""
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.cancelled.append(rid)
                return False
            await asyncio.sleep(0.02)
        return True

    async def stream(self, rid: str | None, chat: bool, body: dict):
        """Token i is "t{i} " (id 100 + i); a body with `resume_token_ids` starts after them (as our nodes do),
        with `return_token_ids` each chunk carries its id (compact JSON, as our nodes write it)."""
        start = len(body.get("resume_token_ids") or ())
        try:
            for i in range(start, self.num_tokens):
                if i > start and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if self.stream_error_after is not None and i == self.stream_error_after:
                    error = {"message": "rank 1 died", "type": "server_error", "param": None, "code": 500}
                    event: dict = {"error": error}
                    if self.moved_params is not None:
                        event = {"error": {**error, "message": "draining", "code": 503},
                                 "kv_transfer_params": self.moved_params}
                    yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n"
                    return
                if self.cut_after is not None and i == self.cut_after:
                    return
                text = f"t{i} " + "x" * self.token_pad
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                self.produced_at.append(time.monotonic())
                if body.get("return_token_ids"):
                    choice["token_ids"] = [100 + i]
                    yield f"data: {json.dumps({'id': f'cmpl-{rid}', 'choices': [choice]}, separators=(',', ':'))}\n\n"
                else:
                    yield f"data: {json.dumps({'id': 'd', 'choices': [choice]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = self.usage(self.num_tokens)
                yield f"data: {json.dumps({'id': f'cmpl-{rid}', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            self.finished.append(rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


class MultiHostTransport(httpx.AsyncBaseTransport):
    """Send each request to the in-process app registered for its host:port; others fail to connect."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self.transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}
        self.refused: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.url.host}:{request.url.port or 80}"
        transport = self.transports.get(key)
        if transport is None or (request.method == "POST" and key in self.refused):
            raise httpx.ConnectError(f"no fake node at {key}", request=request)
        return await transport.handle_async_request(request)
