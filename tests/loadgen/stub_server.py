"""TEST DOUBLE: a tiny OpenAI-compatible streaming server with controlled timing and injected faults.

It generates no text worth reading: it streams `max_tokens` chunks of the word " tok" on a fixed clock
(first output at `ttft_s` after the request arrived, then one chunk every `itl_s`), so the load generator's
TTFT/ITL/TPOT can be checked against known timing; the log keeps each request's arrival and chunk emission
wall-clock times (`time.time()`, comparable across processes on one machine). Faults: every `error_every`-th request answers
`error_status` with OpenAI error JSON; every `disconnect_every`-th request drops the connection after
`disconnect_after` chunks; `include_usage=False` omits the usage chunk; `exit_after=N` kills the process after N requests; `plain_json` answers without streaming; `tokens_per_chunk` bundles tokens.
Used only by tests/loadgen; run as `python -m tests.loadgen.stub_server --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel


class StubConfig(BaseModel):
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    include_usage: bool = True
    error_every: int = 0
    error_status: int = 500
    disconnect_every: int = 0
    disconnect_after: int = 2
    model: str = "stub-model"
    plain_json: bool = False  # answer a non-streaming JSON body instead of SSE
    exit_after: int = 0  # crash the whole process after finishing this many requests (0: never)


class StubState:
    def __init__(self) -> None:
        self.config = StubConfig()
        self.num_requests = 0
        self.log: list[dict] = []
        self.dying = False  # exit_after reached: the process exits before answering anything else


class _Dropped(Exception):
    """Raised inside the body iterator so uvicorn aborts the connection mid-stream."""


def _chunk(endpoint: str, model: str, index: int, text: str, role: bool = False) -> str:
    if endpoint == "chat":
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
    return "data: " + json.dumps({"id": f"stub-{index}", "model": model, "choices": [choice]}) + "\n\n"


async def _stream(state: StubState, cfg: StubConfig, endpoint: str, body: dict, n: int, t_arrival: float,
                  entry: dict):
    max_tokens = int(body.get("max_tokens") or 16)
    prompt_words = len(json.dumps(body.get("messages") or body.get("prompt") or "").split())
    if endpoint == "chat":
        yield _chunk(endpoint, cfg.model, n, "", role=True)
    num_chunks = -(-max_tokens // cfg.tokens_per_chunk)
    drop = cfg.disconnect_every and n % cfg.disconnect_every == 0
    for i in range(num_chunks):
        if drop and i == cfg.disconnect_after:
            raise _Dropped(f"injected disconnect on request {n}")
        due = t_arrival + cfg.ttft_s + i * cfg.itl_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tokens = min(cfg.tokens_per_chunk, max_tokens - i * cfg.tokens_per_chunk)
        entry["emit_unix"].append(time.time())
        yield _chunk(endpoint, cfg.model, n, " tok" * tokens)
    wants_usage = (body.get("stream_options") or {}).get("include_usage")
    if cfg.include_usage and wants_usage:
        usage = {"prompt_tokens": prompt_words, "completion_tokens": max_tokens,
                 "total_tokens": prompt_words + max_tokens}
        yield "data: " + json.dumps({"id": f"stub-{n}", "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"
    if cfg.exit_after and n >= cfg.exit_after:
        state.dying = True  # a request arriving in the next 50 ms must not be answered
        asyncio.get_running_loop().call_later(0.05, os._exit, 0)


def create_app(config: StubConfig | None = None) -> FastAPI:
    app = FastAPI()
    state = StubState()
    state.config = config or StubConfig()
    app.state.stub = state

    async def handle(request: Request, endpoint: str):
        t_arrival, arrival_unix = time.perf_counter(), time.time()
        if state.dying:
            os._exit(0)
        body = await request.json()
        state.num_requests += 1
        n, cfg = state.num_requests, state.config
        entry = {"arrival_unix": arrival_unix, "emit_unix": []}
        state.log.append(entry)
        entry.update({"n": n, "endpoint": endpoint, "session_id": request.headers.get("x-session-id"),
                          "model": body.get("model"), "max_tokens": body.get("max_tokens"),
                          "num_messages": len(body.get("messages") or []), "ignore_eos": body.get("ignore_eos")})
        if cfg.error_every and n % cfg.error_every == 0:
            err = {"message": f"injected error on request {n}", "type": "server_error", "param": None,
                   "code": cfg.error_status}
            return JSONResponse({"error": err}, status_code=cfg.error_status)
        if cfg.plain_json:
            return {"id": f"stub-{n}", "choices": [{"index": 0, "message": {"content": "tok"}}]}
        return StreamingResponse(_stream(state, cfg, endpoint, body, n, t_arrival, entry),
                                 media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.config.model, "object": "model"}]}

    @app.post("/stub/config")
    async def set_config(cfg: StubConfig):
        state.config, state.num_requests, state.log = cfg, 0, []
        return cfg

    @app.get("/stub/log")
    async def get_log():
        return state.log

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
