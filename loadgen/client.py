"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

Sends `stream: true` with `stream_options.include_usage` so the final usage chunk gives the token count;
when the server sends no usage the count falls back to the number of output chunks (flagged in the
record). Every failure becomes a record with an `error_kind` (see records.py); a task cancelled while
streaming (drain deadline, Ctrl-C) writes a "cancelled" record before re-raising.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx

from loadgen import records as rk
from loadgen.metrics import request_timing
from loadgen.records import RequestRecord
from loadgen.schedule import RequestSpec

Endpoint = Literal["chat", "completions"]
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class Target:
    """Where and how to send: base URL (without /v1), model name (None until resolved), endpoint kind, extra body fields."""

    base_url: str
    model: str | None
    endpoint: Endpoint = "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    extra_headers: dict[str, str] = field(default_factory=dict)
    logprobs: bool = False
    """Ask for each output token's log-prob and record them (`loadgen compare` counts mismatches)."""

    def url(self) -> str:
        return self.base_url.rstrip("/") + _PATHS[self.endpoint]

    def body(self, spec: RequestSpec) -> dict:
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "max_tokens": spec.max_tokens, "temperature": 0.0}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs:
            body.update({"logprobs": True, "top_logprobs": 0} if self.endpoint == "chat" else {"logprobs": 0})
        if self.endpoint == "chat":
            body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
        else:
            body["prompt"] = spec.prompt()
        return body

    def headers_base(self) -> dict[str, str]:
        headers = dict(self.extra_headers)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def headers(self, spec: RequestSpec) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", **self.headers_base()}
        if spec.session_id:
            headers["X-Session-ID"] = spec.session_id
        return headers


def has_output(endpoint: Endpoint, choice: dict) -> bool:
    """Whether a streamed choice carries a generated token: vllm bench serve's test, except that a
    `"role": null` key counts as absent (servers that serialise unset fields send it on every chunk)."""
    if endpoint == "completions":
        return "text" in choice
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    keys = ("content", "reasoning", "reasoning_content", "tool_calls", "function_call")
    if any(delta.get(key) for key in keys):
        return True
    return delta.get("content") == "" and delta.get("role") is None


@dataclass
class _Stream:
    """Mutable state while one stream is read."""

    chunk_s: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False
    num_events: int = 0
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", body[:200].decode(errors="replace")))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


class _StreamFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _consume(data: str, endpoint: Endpoint, state: _Stream, now: float) -> None:
    if data.strip() == "[DONE]":
        state.done = True
        return
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise _StreamFailure(rk.BAD_RESPONSE, f"chunk is not JSON: {data[:120]!r}") from None
    if not isinstance(obj, dict):
        raise _StreamFailure(rk.BAD_RESPONSE, f"chunk is not an object: {data[:120]!r}")
    if "error" in obj:
        err = obj["error"]
        raise _StreamFailure(rk.STREAM_ERROR, str(err.get("message", err) if isinstance(err, dict) else err))
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict) and has_output(endpoint, choices[0]):
        state.chunk_s.append(now)
    if choices and isinstance(choices[0], dict) and isinstance(choices[0].get("logprobs"), dict):
        _take_logprobs(endpoint, choices[0]["logprobs"], state)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        state.completion_tokens = usage.get("completion_tokens", state.completion_tokens)
        state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            state.cached_tokens = details["cached_tokens"]


def _take_logprobs(endpoint: Endpoint, logprobs: dict, state: _Stream) -> None:
    """Append a chunk's per-token log-probs (completions: tokens / token_logprobs; chat: content entries)."""
    if endpoint == "completions":
        state.tokens += [str(t) for t in logprobs.get("tokens") or []]
        state.logprobs += list(logprobs.get("token_logprobs") or [])
        return
    for entry in logprobs.get("content") or []:
        if isinstance(entry, dict):
            state.tokens.append(str(entry.get("token")))
            state.logprobs.append(entry.get("logprob"))


async def _read_stream(resp: httpx.Response, spec: RequestSpec, target: Target, state: _Stream, t0: float) -> bool:
    """Read SSE lines into `state`; True if the client stopped early (cancel_after_tokens)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        state.num_events += 1
        _consume(line[5:].lstrip(), target.endpoint, state, time.perf_counter() - t0)
        if spec.cancel_after_tokens is not None and len(state.chunk_s) >= spec.cancel_after_tokens:
            return True
        if state.done:
            break
    return False


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec, concurrency: int, t0: float,
               sink: list[RequestRecord], queued_s: float = 0.0) -> RequestRecord:
    """Send `spec`, append its record to `sink` (also on cancellation) and return it."""
    state = _Stream()
    start = time.perf_counter() - t0
    outcome, kind, message, status = "error", None, None, None
    try:
        async with client.stream("POST", target.url(), json=target.body(spec), headers=target.headers(spec)) as resp:
            status = resp.status_code
            if status != 200:
                kind, message = rk.http_kind(status), _error_message(await resp.aread())
            elif await _read_stream(resp, spec, target, state, t0):
                outcome, kind, message = "cancelled", rk.CANCELLED, f"client closed after {len(state.chunk_s)} chunks"
            elif not state.num_events:
                kind = rk.BAD_RESPONSE
                message = f"HTTP 200 without SSE data lines (content-type {resp.headers.get('content-type')!r})"
            elif not state.done:
                kind, message = rk.DISCONNECT, "stream ended before [DONE]"
            elif not state.chunk_s:
                kind, message = rk.NO_TOKENS, "stream finished without any output chunk"
            else:
                outcome = "ok"
    except _StreamFailure as exc:
        kind, message = exc.kind, str(exc)
    except httpx.ConnectError as exc:
        kind, message = rk.CONNECT, f"cannot connect to {target.url()}: {exc}"
    except httpx.TimeoutException as exc:
        kind, message = rk.TIMEOUT, f"{type(exc).__name__}: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        kind, message = rk.DISCONNECT, f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        kind, message = rk.DISCONNECT, f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        outcome, kind, message = "cancelled", rk.CANCELLED, "cancelled by the client (drain deadline or interrupt)"
        sink.append(_record(spec, concurrency, outcome, kind, message, status, state, start, t0, queued_s))
        raise
    record = _record(spec, concurrency, outcome, kind, message, status, state, start, t0, queued_s)
    sink.append(record)
    return record


def _record(spec: RequestSpec, concurrency: int, outcome: str, kind: str | None, message: str | None,
            status: int | None, state: _Stream, start: float, t0: float, queued_s: float) -> RequestRecord:
    from_usage = outcome == "ok" and bool(state.completion_tokens)
    num_out = int(state.completion_tokens) if from_usage else len(state.chunk_s)
    timing = request_timing(start, state.chunk_s, num_out) if outcome == "ok" else None
    return RequestRecord(
        request_id=spec.request_id, session_id=spec.session_id, concurrency=concurrency, outcome=outcome,
        error_kind=None if outcome == "ok" else kind, error=message, http_status=status, queued_s=queued_s,
        start_s=start, end_s=time.perf_counter() - t0, chunk_s=state.chunk_s,
        num_input_tokens=spec.num_input_tokens, max_tokens=spec.max_tokens, prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens, output_tokens=num_out, tokens_from_usage=from_usage,
        cached_tokens=state.cached_tokens,
        ttft_s=timing.ttft_s if timing else None, e2e_s=timing.e2e_s if timing else None,
        tpot_s=timing.tpot_s if timing else None, itl_s=list(timing.itl_s) if timing else [],
        tokens=state.tokens, logprobs=state.logprobs,
    )
