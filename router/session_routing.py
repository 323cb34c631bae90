"""The session side of a request, between the HTTP edge and the legs (service.py calls these).

- `identify`: the tenant (API key, router/identity.py) and the hashed session key of a request.
- `prompt_estimate`: the prompt's token count without tokenizing: the byte-level chat template of the
  reference engine when every decode instance runs it (exact), else characters / `chars_per_token`.
- `expected_growth`: the `X-Expected-Context-Tokens` hint, bounded (at most 12 digits, else 400).
- `after_turn`: a finished turn's bookkeeping: what the decode instance (prompt + answer) and the P leg's
  prefill instance (prompt) now hold for the session (router/cache_view.py), and the cache counters.
- usage truth: the client sees `usage.prompt_tokens_details.cached_tokens` = what was not computed for it.
  When a P leg ran, that is the prefill node's own figure (the decode node computed no prompt token, it
  reports what it did not read); `rewrite_usage` and `UsageRewriter` (streams) put the prefill figure in the
  decode node's answer. Colocated or with the P leg skipped, the decode node's figure is already the truth.
  After a move (router/moves.py) the figure is the placement's that finished the answer (its P leg's, or the
  resuming decode node's), never more than `prompt_tokens`: the client's prompt was computed again there, and
  what that placement did not compute is what the client got from a cache (the resumed tokens are output, not
  prompt). A non-streamed answer runs again in full, so its figure and `x-pdcluster-decode` header are the
  last placement's; a stream's headers are sent with its first chunk and keep naming its first instance.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson

from router.identity import session_key
from router.placement import estimate_prompt_tokens, estimate_prompt_tokens_bytes
from serving.errors import APIError

MAX_HINT_DIGITS = 12
SESSION_HEADER = "x-pdcluster-session"


def identify(state, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The request's session key (None: no session); 401 / 400 as APIError."""
    tenant = state.api_keys.tenant(headers.get("authorization"))
    return session_key(tenant, headers, body)


def is_byte_level(state) -> bool:
    mode = state.settings.prompt_estimate
    if mode != "auto":
        return mode == "bytes"
    engines = {s.geometry.engine if s.geometry else s.spec.engine for s in state.registry.states()
               if s.spec.role == "decode"}
    return engines == {"reference"}


def prompt_estimate(state, body: Mapping[str, Any]) -> int:
    if is_byte_level(state):
        return estimate_prompt_tokens_bytes(body)
    return estimate_prompt_tokens(body, state.settings.chars_per_token)


def expected_growth(headers: Mapping[str, str], default: int) -> int:
    hint = headers.get("x-expected-context-tokens")
    if hint is None or hint == "":
        return default
    if len(hint) > MAX_HINT_DIGITS or not (hint.isascii() and hint.isdigit()):
        raise APIError(400, f"X-Expected-Context-Tokens must be a non-negative integer of at most {MAX_HINT_DIGITS} "
                            "digits", "X-Expected-Context-Tokens")
    return int(hint)


def cached_tokens_of(usage: object) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`, when present and an int."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _set_cached(usage: dict, cached: int) -> None:
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    details["cached_tokens"] = cached


def _truth(usage: dict, cached: int | None) -> int | None:
    """The cached_tokens the client sees: `cached` (a P leg's figure) or else the node's, at most prompt_tokens;
    None when the usage's figure is already that."""
    now = cached_tokens_of(usage)
    want = now if cached is None else cached
    prompt = usage.get("prompt_tokens")
    if want is not None and isinstance(prompt, int) and not isinstance(prompt, bool):
        want = min(want, prompt)
    return None if want is None or want == now else want


def rewrite_usage(content: bytes, cached: int | None) -> bytes:
    """A whole JSON answer with its usage's cached_tokens set to `cached` (or the node's when None), at most
    prompt_tokens; the same bytes when nothing changes."""
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict) or (want := _truth(usage, cached)) is None:
        return content
    _set_cached(usage, want)
    return orjson.dumps(answer)


class UsageRewriter:
    """Rewrites the cached_tokens of the usage events of an SSE byte stream (`cached()`, asked when the usage
    event passes: the placement that finished the stream may not be its first). A chunk of whole events without
    `"usage"` passes through untouched; otherwise bytes go out up to the last complete event (the rest waits
    for the next chunk), and usage events are rewritten whole."""

    def __init__(self, cached: Callable[[], int | None]) -> None:
        self.cached = cached
        self.pending = b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or b'"usage"' not in event:
            return event
        try:
            payload = orjson.loads(event[5:].strip())
        except orjson.JSONDecodeError:
            return event
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict) or (want := _truth(usage, self.cached())) is None:
            return event
        _set_cached(usage, want)
        return b"data: " + orjson.dumps(payload)

    def feed(self, chunk: bytes) -> bytes:
        if not self.pending and b'"usage"' not in chunk and chunk.endswith(b"\n\n"):
            return chunk
        data = self.pending + chunk
        head, sep, self.pending = data.rpartition(b"\n\n")
        if not sep:
            self.pending = data
            return b""
        return b"\n\n".join(self._event(e) for e in head.split(b"\n\n")) + b"\n\n"

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


async def with_cached_tokens(stream: AsyncIterator[bytes], cached: Callable[[], int | None]) -> AsyncIterator[bytes]:
    """`stream` with its usage events' cached_tokens set to `cached()` (see `UsageRewriter`; closing this closes
    `stream`)."""
    rewriter = UsageRewriter(cached)
    try:
        async for chunk in stream:
            out = rewriter.feed(chunk)
            if out:
                yield out
        rest = rewriter.flush()
        if rest:
            yield rest
    finally:
        await stream.aclose()


def client_cached_tokens(ctx, usage: object) -> int | None:
    """The cached_tokens the client saw: the P leg's when one ran, else the decode node's."""
    if ctx.handoff is not None and ctx.prefill_cached_tokens is not None:
        return ctx.prefill_cached_tokens
    return cached_tokens_of(usage)


def after_turn(state, ctx, usage: dict | None, now: float) -> None:
    """Counters and cache bookkeeping once an `ok` request's usage is known."""
    if not isinstance(usage, dict):
        return
    pool = ctx.placement.pool
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) and prompt >= 0 else 0
    completion = completion if isinstance(completion, int) and completion >= 0 else 0
    cached = client_cached_tokens(ctx, usage) or 0
    m = state.metrics
    m.child(m.prompt_tokens, pool).inc(prompt)
    m.child(m.cached_prompt_tokens, pool).inc(min(cached, prompt))
    if not ctx.placement.disaggregate and ctx.placement.cached_tokens_estimate > 0:
        m.child(m.prefill_skipped, pool).inc()
    key = ctx.shape.session_id
    if not key:
        return
    state.cache_view.note_served(ctx.placement.decode, key, prompt + completion, now,
                                 resumable=prompt + completion - 1 if completion > 0 else 0)
    if ctx.handoff is not None:
        state.cache_view.note_served(ctx.handoff.prefill, key, prompt, now)
