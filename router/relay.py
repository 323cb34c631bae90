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

import anyio
import orjson

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


async def relay(resp: UpstreamResponse, chunks: AsyncIterator[bytes], first: bytes, acct: StreamAccounting,
                idle_timeout_s: float, on_end) -> AsyncIterator[bytes]:
    """Yield D's bytes unchanged but for the messages of error events, scrubbed of internal names
    (serving/errors.py `scrub_sse_chunk`); `on_end(status)` runs once at the end, shielded from cancellation.

    status: "ok", "timeout" (idle gap exceeded), "upstream_error" (the stream broke, ended without [DONE], or
    carried D's error event) or "cancelled" (client gone).
    """
    status = "cancelled"
    watchdog = None
    try:
        acct.feed(first, time.monotonic())
        yield scrub_sse_chunk(first)
        watchdog = IdleWatchdog(idle_timeout_s)
        while True:
            watchdog.wait()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                acct.ended_at = time.monotonic()
                status = "ok" if acct.is_done and acct.error is None else "upstream_error"
                break
            except asyncio.CancelledError:
                if not watchdog.fired:
                    raise
                asyncio.current_task().uncancel()
                acct.ended_at = time.monotonic()
                status = "timeout"
                yield error_event(504, f"decode stream idle for more than {idle_timeout_s} s")
                break
            except UPSTREAM_ERRORS as exc:
                acct.ended_at = time.monotonic()
                status = "upstream_error"
                yield error_event(502, f"decode stream broke: {type(exc).__name__}")
                break
            watchdog.waiting = False
            acct.feed(chunk, time.monotonic())
            yield scrub_sse_chunk(chunk)
    finally:
        if watchdog is not None:
            watchdog.stop()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
            on_end(status)
