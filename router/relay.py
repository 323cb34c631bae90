"""Streaming relay: D's SSE bytes go to the client as they arrive (no buffering, no re-encoding).

A side parser (`StreamAccounting`) splits the bytes into SSE events only to time them: first token,
gaps between token-bearing events, and the final usage. A plain token event (one compact `data:` line with
non-empty text or content and no usage or error key: what engines stream per token) is recognised from its
bytes; every other event's JSON is read with orjson. Error events have their messages scrubbed of internal names on the way
(the only bytes the relay may change). `ended_at` marks when D's stream ended, closing the D leg's time.
When the stream ends early (idle timeout, upstream error) the client gets an OpenAI error event and
`[DONE]`; when the client goes away the upstream connection is closed and both legs are aborted. Cleanup
runs shielded from cancellation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import orjson

from router.migration import is_final_event, token_ids_in
from router.upstream import UPSTREAM_ERRORS, UpstreamResponse
from serving.errors import error_body, scrub_sse_chunk


@dataclass
class StreamAccounting:
    """Timing and usage of one relayed SSE stream.

    Per relayed chunk: its complete events are split off in one pass (no copy of the rest per event) and each
    event's JSON is read once; the token events of one chunk share its arrival time, so the chunk is recorded
    once with its count (`token_times`, `token_counts`) instead of once per event."""

    started: float
    started_relay: float = 0.0
    """When D's first chunk arrived (the relay's start)."""
    buffer: bytes = b""
    token_times: list[float] = field(default_factory=list)
    """Arrival time of each chunk that carried token events."""
    token_counts: list[int] = field(default_factory=list)
    """How many token events each of those chunks carried."""
    num_token_events: int = 0
    usage: dict | None = None
    is_done: bool = False
    ended_at: float | None = None
    """When D's stream ended (cleanly or not); None while it runs or when the client left first."""
    error: str | None = None
    """The message of an OpenAI error event D sent inside the stream (the stream then failed, [DONE] or not)."""
    error_status: int | None = None
    """That error event's `code` (an HTTP status), when it has one."""
    tracks_ids: bool = False
    """Collect the streamed token ids (a resumable stream: router/migration.py)."""
    token_ids: list[int] = field(default_factory=list)
    """The token ids of the events relayed so far (`tracks_ids`)."""
    is_finished: bool = False
    """An event carried a finish reason (`tracks_ids`)."""
    move_params: dict | None = None
    """The `kv_transfer_params` of D's error event when the node moved the stream out with its KV on drain
    (decode_node/moves.py): the next instance READs the rows instead of recomputing them."""

    def feed(self, chunk: bytes, now: float) -> None:
        if self.buffer:
            chunk = self.buffer + chunk
        end = chunk.rfind(b"\n\n")
        if end < 0:
            self.buffer = chunk
            return
        self.buffer = chunk[end + 2:]
        num = 0
        for event in chunk[:end].split(b"\n\n"):
            num += 1 if _is_plain_token_event(event) else self._event(event)
            if self.tracks_ids:
                self.token_ids += token_ids_in(event)
                self.is_finished = self.is_finished or is_final_event(event)
        if num:
            self.token_times.append(now)
            self.token_counts.append(num)
            self.num_token_events += num

    def _event(self, event: bytes) -> int:
        """How many of the event's data lines carry output (text, content, reasoning or tool calls)."""
        num = 0
        for line in event.split(b"\n") if b"\n" in event else (event,):
            if not line.startswith(b"data:"):
                continue
            data = line[5:]
            if data.strip() == b"[DONE]":
                self.is_done = True
                continue
            try:
                payload = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(payload, dict) and self._payload(payload):
                num += 1
        return num

    def _payload(self, payload: dict) -> bool:
        if isinstance(payload.get("error"), dict):
            self.error = str(payload["error"].get("message") or "error event without a message")
            code = payload["error"].get("code")
            self.error_status = code if isinstance(code, int) else None
            params = payload.get("kv_transfer_params")
            self.move_params = params if isinstance(params, dict) else None
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or ():
            text = choice.get("text")
            if text:
                return True
            delta = choice.get("delta")
            if delta and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                return True
        return False

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    def itl_counts(self) -> list[tuple[float, int]]:
        """The gaps between consecutive token events as (gap, how many): the first event of a chunk follows
        the previous chunk's last; the others of a chunk arrived with it (gap 0)."""
        out = []
        times, counts = self.token_times, self.token_counts
        for i, num in enumerate(counts):
            if i:
                out.append((times[i] - times[i - 1], 1))
            if num > 1:
                out.append((0.0, num - 1))
        return out

    def itls(self) -> list[float]:
        return [gap for gap, num in self.itl_counts() for _ in range(num)]


def _has_text(event: bytes, key: bytes) -> bool:
    """`key` (e.g. b'"text":"') followed by at least one character of its string value."""
    at = event.find(key)
    return at >= 0 and event[at + len(key) : at + len(key) + 1] not in (b'"', b"")


def _is_plain_token_event(event: bytes) -> bool:
    """An event the side parser need not read as JSON: one `data: ` line carrying a choice's non-empty `text`
    (completions) or delta `content` (chat), and no `usage` or `error` key. What an engine streams per token
    looks like this (compact JSON); anything else (usage, error, role-only or tool-call deltas, spaced JSON,
    several lines) goes through `_event`. Inside JSON strings quotes are escaped, so a pattern like `"usage"`
    or `"text":"` in the bytes can only be a key, never part of a value."""
    return (event.startswith(b"data: {") and b"\n" not in event and b'"usage"' not in event
            and b'"error"' not in event
            and (_has_text(event, b'"text":"') or _has_text(event, b'"content":"')))


class IdleWatchdog:
    """Cancels `task` once it waited `idle_s` for a chunk (`fired` then says why it was cancelled); time
    spent handing a chunk to the client (`waiting` False) does not count.

    One timer per idle interval instead of one per chunk: a chunk only records the time; the timer, when
    it fires early, re-arms itself for the latest chunk's deadline."""

    def __init__(self, idle_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.idle_s = idle_s
        self.last = self.loop.time()
        self.fired = False
        self.waiting = True
        self.handle = self.loop.call_at(self.last + idle_s, self._check)

    def wait(self) -> None:
        """About to wait for the next chunk."""
        self.last = self.loop.time()
        self.waiting = True

    def _check(self) -> None:
        deadline = self.last + self.idle_s
        if not self.waiting:
            self.handle = self.loop.call_at(self.loop.time() + self.idle_s, self._check)
        elif self.loop.time() >= deadline:
            self.fired = True
            self.task.cancel()
        else:
            self.handle = self.loop.call_at(deadline, self._check)

    def stop(self) -> None:
        self.handle.cancel()


def error_event(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"


class Resumer(Protocol):
    """What a resumable stream's relay calls (router/service.py `StreamResume`, router/migration.py)."""

    message: str
    """Why the last `reopen` gave up (the client's error event)."""

    async def reopen(self, reason: str) -> tuple[UpstreamResponse, AsyncIterator[bytes], bytes] | None:
        """The request on another decode instance, continuing after the relayed tokens: (response, chunks,
        first chunk), or None when it cannot move again."""

    def client_bytes(self, chunk: bytes) -> bytes:
        """A relayed chunk as the client sees it."""


def _before_error(chunk: bytes) -> bytes:
    """The events of `chunk` before a node's error event (`data: {"error"`)."""
    at = chunk.find(b'data: {"error"')
    return chunk[:at] if at > 0 else b""


async def relay(resp: UpstreamResponse, chunks: AsyncIterator[bytes], first: bytes, acct: StreamAccounting,
                idle_timeout_s: float, on_end, resume: Resumer | None = None) -> AsyncIterator[bytes]:
    """Yield D's bytes unchanged but for the messages of error events, scrubbed of internal names
    (serving/errors.py `scrub_sse_chunk`); `on_end(status)` runs once at the end, shielded from cancellation.

    status: "ok", "timeout" (idle gap exceeded), "upstream_error" (the stream broke, ended without [DONE], or
    carried D's error event) or "cancelled" (client gone). With `resume`, a failure before the stream's finish
    reason (broken, cut, idle, a 5xx error event, which is then not relayed) continues on the stream
    `resume.reopen` opens; the client sees one stream (`resume.client_bytes`) or, when it cannot move, one
    error event and `[DONE]`.
    """
    status = "cancelled"
    # [DONE] (no error event before it) was relayed and the client's side asked for more: it has the whole stream,
    # so leaving now (a client that stops reading at [DONE], racing D's own close) is a clean end, not a cancel
    # that would skip the turn's session record, latency metrics and the legs' success
    delivered = False
    watchdog = None
    pending: bytes | None = first
    to_client = resume.client_bytes if resume is not None else _same
    try:
        watchdog = IdleWatchdog(idle_timeout_s)
        while True:
            failure: tuple[str, str, int, str] | None = None
            if pending is not None:
                chunk, pending = pending, None
            else:
                delivered = acct.is_done and acct.error is None
                watchdog.wait()
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    acct.ended_at = time.monotonic()
                    if acct.is_done and acct.error is None:
                        status = "ok"
                        break
                    failure = ("stream_broke", "upstream_error", 0, "decode stream ended before [DONE]")
                except asyncio.CancelledError:
                    if not watchdog.fired:
                        raise
                    asyncio.current_task().uncancel()
                    watchdog.fired = False
                    acct.ended_at = time.monotonic()
                    failure = ("timeout", "timeout", 504, f"decode stream idle for more than {idle_timeout_s} s")
                except UPSTREAM_ERRORS as exc:
                    acct.ended_at = time.monotonic()
                    failure = ("stream_broke", "upstream_error", 502, f"decode stream broke: {type(exc).__name__}")
            if failure is None:
                watchdog.waiting = False
                had_error = acct.error is not None
                acct.feed(chunk, time.monotonic())
                if resume is None or had_error or acct.error is None or (acct.error_status or 500) < 500 \
                        or acct.is_finished:
                    yield to_client(scrub_sse_chunk(chunk))
                    continue
                head = _before_error(chunk)  # a node's 5xx error event: resume instead of relaying it
                if head:
                    yield to_client(scrub_sse_chunk(head))
                acct.ended_at = time.monotonic()
                failure = ("drain" if acct.move_params is not None else "error_event", "upstream_error", 502,
                           f"decode failed: {acct.error}")
            reason, status, code, message = failure
            if resume is not None and not acct.is_finished:
                watchdog.waiting = False  # moving is not idle time
                await resp.aclose()
                opened = await resume.reopen(reason)
                if opened is not None:
                    resp, chunks, pending = opened
                    status = "cancelled"
                    acct.error = acct.error_status = acct.ended_at = acct.move_params = None
                    acct.is_done = False
                    continue
                code, message = code or 502, resume.message
            if code:
                yield error_event(code, message)
            break
    finally:
        if watchdog is not None:
            watchdog.stop()
        if status == "cancelled" and delivered:
            status = "ok"
        with anyio.CancelScope(shield=True):
            await resp.aclose()
            on_end(status)


def _same(chunk: bytes) -> bytes:
    return chunk
