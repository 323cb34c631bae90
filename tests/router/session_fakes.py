"""Fake nodes that implement the node half of docs/SESSIONS.md, for router tests without engines.

`CacheNode` counts prompt tokens as the reference engine's byte-level tokenizer does (the router's own
estimator, which tests/router/test_cache_routing.py checks against the real tokenizer), keeps per session
the tokens of its last turn (a prefill node: the prompt; a decode node: prompt + answer), answers
`GET /v1/cache`, and reports `usage.prompt_tokens_details.cached_tokens` = the prefix it did not compute
(prefill, colocated) or did not read (decode in PD). Every request's headers and body are recorded.
`cache_on=False` is the node cache switch: nothing held, cached_tokens 0, empty `sessions`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.placement import estimate_prompt_tokens_bytes
from tests.router.fakes import MODEL


@dataclass
class CacheNode:
    name: str
    role: str
    cache_on: bool = True
    num_tokens: int = 4
    held: dict[str, int] = field(default_factory=dict)
    queried_tokens: int = 0
    hits_tokens: int = 0
    requests: list[dict] = field(default_factory=list)
    """Per request: path, body, the x-pdcluster-session and x-pdcluster-tenant headers, cached tokens answered."""

    def metrics_text(self) -> str:
        return ('# TYPE vllm:cache_config_info gauge\n'
                'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="100",engine="0"} 1.0\n')

    def _lookup(self, session: str | None, prompt: int) -> int:
        if not self.cache_on:
            return 0
        self.queried_tokens += prompt
        cached = min(self.held.get(session, 0), prompt - 1) if session else 0
        self.hits_tokens += max(cached, 0)
        return max(cached, 0)

    def app(self) -> FastAPI:
        app, node = FastAPI(), self

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(node.metrics_text(), media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 100_000}]}

        @app.get("/v1/cache")
        async def cache() -> dict:
            return {"engine_id": f"engine-{node.name}", "block_tokens": 16, "fingerprint": "fp", "sessions": dict(node.held) if node.cache_on else {},
                    "blocks_cached": sum(node.held.values()) // 16, "rows_free": 1000,
                    "hits_tokens": node.hits_tokens, "queried_tokens": node.queried_tokens, "evicted_blocks": 0,
                    "resumable": {s: t - t % 16 for s, t in node.held.items()} if node.cache_on else {}}

        @app.post("/abort_requests")
        async def abort(request: Request) -> dict:
            return {"aborted": True}

        async def generate(request: Request) -> Response:
            body = await request.json()
            session = request.headers.get("x-pdcluster-session")
            prompt = estimate_prompt_tokens_bytes(body)
            cached = node._lookup(session, prompt)
            node.requests.append({"path": request.url.path, "body": body, "session": session, "cached": cached,
                                  "tenant": request.headers.get("x-pdcluster-tenant")})
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                if session and node.cache_on:
                    node.held[session] = prompt
                handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
                           "remote_engine_id": f"engine-{node.name}", "remote_request_id": "r",
                           "remote_host": "localhost", "remote_port": 5600, "tp_size": 1,
                           "decode_engine_id": params.get("decode_engine_id")}
                return JSONResponse({"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                     "usage": node._usage(prompt, 1, cached), "kv_transfer_params": handoff})
            if session and node.cache_on:
                node.held[session] = prompt + node.num_tokens
            chat = request.url.path.endswith("chat/completions")
            usage = node._usage(prompt, node.num_tokens, cached)
            if body.get("stream"):
                return StreamingResponse(node._stream(chat, body, usage), media_type="text/event-stream")
            text = "".join(f"t{i} " for i in range(node.num_tokens))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            return JSONResponse({"id": "d", "choices": [{**choice, "finish_reason": "length"}], "usage": usage})

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)
        return app

    @staticmethod
    def _usage(prompt: int, completion: int, cached: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _stream(self, chat: bool, body: dict, usage: dict):
        for i in range(self.num_tokens):
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            yield f"data: {json.dumps({'id': 'd', 'choices': [choice]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            # split the usage event across two writes: the router must rewrite it whole
            event = f"data: {json.dumps({'id': 'd', 'choices': [], 'usage': usage})}\n\n"
            yield event[:20]
            yield event[20:]
        yield "data: [DONE]\n\n"
