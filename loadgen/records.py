"""The raw per-request record every metric is computed from, as written to summary.json.

Times are seconds from the start of the record's concurrency level (one `time.perf_counter` origin).
`chunk_s` holds the arrival time of every streamed chunk that carried output (a content delta, or an
empty-string delta without a role, as vllm bench serve counts); the usage-only and [DONE] chunks are not
in it. Outcome "ok" = the stream ended with [DONE] and at least one output chunk; "cancelled" = the client
closed the stream (interrupt or drain deadline); "error" = anything else, with `error_kind`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Outcome = Literal["ok", "error", "cancelled"]

# error_kind values
CONNECT = "connect"  # could not connect (refused, DNS, ...)
TIMEOUT = "timeout"  # connect/read timed out
DISCONNECT = "disconnect"  # the server dropped the stream mid-way or ended it without [DONE]
STREAM_ERROR = "stream_error"  # an error object inside the stream
BAD_RESPONSE = "bad_response"  # a chunk that is not JSON / not the OpenAI shape
NO_TOKENS = "no_tokens"  # 200 and [DONE] but no output chunk
CANCELLED = "cancelled"  # client-side cancel (only as outcome)


def http_kind(status: int) -> str:
    return f"http_{status}"


class RequestRecord(BaseModel):
    """One request as measured by the client (see module docstring for the time origin)."""

    request_id: str
    session_id: str | None = None
    concurrency: int
    outcome: Outcome
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    queued_s: float = 0.0
    start_s: float
    end_s: float
    chunk_s: list[float] = Field(default_factory=list)
    num_input_tokens: int = 0
    max_tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    """The usage's `prompt_tokens_details.cached_tokens` (prompt tokens a prefix cache supplied), if reported."""
    output_tokens: int = 0
    tokens_from_usage: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    """Output tokens as the server named them, when the run asked for log-probs (`--logprobs`)."""
    logprobs: list[float | None] = Field(default_factory=list)
    """Each output token's log-prob as served (exact JSON floats), when asked."""

    @property
    def is_ok(self) -> bool:
        return self.outcome == "ok"
