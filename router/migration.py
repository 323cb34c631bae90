"""Request migration: a request whose decode instance failed resumes on another one, continuing the same answer.

What makes it exact: our nodes' sampler draws output token n from (seed, n) and the request's own tokens only
(engine/sampling.py), and a node told `resume_token_ids` (the tokens the client already has) appends them to the
prompt and continues from the next one (node/textgen.py, `SamplingParams.num_resumed`). So the router:
- at first placement on our engine (`reference`), fixes a seed the client did not send (a random one, so an
  unseeded request still samples freshly each time) and asks the stream for its token ids
  (`return_token_ids`; stripped again from the bytes the client gets unless it asked for them);
- on a decode failure (stream broke or ended without `[DONE]`, an in-stream 5xx error event, no first byte or
  chunk within its timeout, a 5xx answer, the instance unreachable), aborts the lost legs, places the request
  again with the failed instances blocked (the usual placement: another pool when it fits, a P leg or
  colocated) and sends it with `resume_token_ids` under a new leg id (`<id>-m<n>`, so a late abort of the lost
  legs never reaches the new ones; the relay writes the client's response id back into the chunks);
- stops after `migration_limit` moves or `migration_timeout_s` after the first failure: the client then gets
  one clean error (an in-stream error event and `[DONE]` for streams).
Non-streaming requests resume the same way with no tokens sent (the whole answer is computed again).
vLLM pools do not resume (they lack `resume_token_ids`): their failures end the request as before.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

REASONS = ("stream_broke", "error_event", "timeout", "unreachable", "error_status", "drain", "session_growth")
"""`pdcluster_migrations_total{reason}`: why a request left its decode instance ("drain": the draining node moved
the stream out with its KV, router/moves.py; "session_growth": a session outgrew its pool and its kept KV moved
decode-to-decode to the new pool's instance, router/placement.py `move_source`)."""

_TOKEN_IDS = re.compile(rb',"token_ids":\[[0-9,]*\]')
_TOKEN_IDS_KEY = b'"token_ids":['


@dataclass
class Migration:
    """One request's migration state (built at its first placement on a resumable decode instance)."""

    request_id: str
    limit: int
    timeout_s: float
    strip_token_ids: bool
    """The client did not ask for `return_token_ids`: the relay removes them from what it sends."""
    num_moves: int = 0
    first_failure: float | None = None
    failed: set[str] = field(default_factory=set)
    """Decode instances this request failed on (blocked for its next placements)."""
    last_reason: str = ""

    @property
    def leg_request_id(self) -> str:
        """The X-Request-Id of the current legs."""
        return self.request_id if not self.num_moves else f"{self.request_id}-m{self.num_moves}"

    def can_move(self, now: float) -> bool:
        if self.num_moves >= self.limit:
            return False
        return self.first_failure is None or now - self.first_failure <= self.timeout_s

    def exhausted_message(self, now: float) -> str:
        if self.num_moves >= self.limit:
            return f"the decode instance failed ({self.last_reason}) and the request had moved {self.num_moves} " \
                   f"time(s), its limit"
        since = now - (self.first_failure or now)
        return f"the decode instance failed ({self.last_reason}) and no other could resume the request within " \
               f"{since:.1f} s"

    def note_failure(self, decode: str, reason: str, now: float) -> None:
        self.failed.add(decode)
        self.last_reason = reason
        if self.first_failure is None:
            self.first_failure = now

    def client_bytes(self, chunk: bytes) -> bytes:
        """A relayed chunk as the client sees it: the leg's id back to the request's, token ids stripped unless
        asked for."""
        if self.num_moves:
            chunk = chunk.replace(f"{self.leg_request_id}\"".encode(), f"{self.request_id}\"".encode())
        if self.strip_token_ids and _TOKEN_IDS_KEY in chunk:
            chunk = _TOKEN_IDS.sub(b"", chunk)
        return chunk


def start(request_id: str, body: dict, engine: str | None, limit: int, timeout_s: float,
          is_stream: bool) -> Migration | None:
    """Make the request resumable on our engine (None elsewhere, or with `limit` 0): a fixed seed and, for
    streams, token ids in the chunks. Edits `body` (the router's own copy of the client's)."""
    if engine != "reference" or limit <= 0 or body.get("echo") is True or body.get("prompt_logprobs") is not None:
        return None
    if body.get("seed") is None:
        body["seed"] = random.getrandbits(63)
    wants_ids = body.get("return_token_ids") is True
    if is_stream:
        body["return_token_ids"] = True
    return Migration(request_id, limit, timeout_s, strip_token_ids=is_stream and not wants_ids)


def token_ids_in(event: bytes) -> list[int]:
    """The `token_ids` of one compact SSE event from our nodes (empty when it carries none)."""
    at = event.find(_TOKEN_IDS_KEY)
    if at < 0:
        return []
    start = at + len(_TOKEN_IDS_KEY)
    end = event.find(b"]", start)
    inner = event[start:end]
    return [int(x) for x in inner.split(b",")] if inner else []


def is_final_event(event: bytes) -> bool:
    """A compact event from our nodes whose choice carries a finish reason."""
    return b'"finish_reason":' in event and b'"finish_reason":null' not in event
