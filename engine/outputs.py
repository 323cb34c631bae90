"""`TokenEvent`: one generated token of one request, the single per-token type from the engine step through
the rank protocol (engine/api.py) to the HTTP layer (node/textgen.py, node/responses.py).

A per-token field (a log-prob, top-k log-probs, a timing) is added here, filled where the engine samples,
and rendered where responses are built; nothing converts it on the way. Prompt log-probs are the same events,
one per prompt position, in a `PromptLogprobs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenEvent:
    """A generated token; `finish_reason` ("stop", "length", "abort") on the request's last event.

    An abort ends a request with an event whose `token_id` is None."""

    request_id: str
    token_id: int | None
    index: int = 0
    """Position in the output (0 = the first generated token)."""
    logprob: float = math.nan
    """Natural-log probability of `token_id` under the distribution it was sampled from (NaN: not known)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens at this position with their log-probs, most likely first (empty unless asked)."""
    rank: int = 0
    """1 + how many tokens are strictly more likely than `token_id` here (0: not known)."""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV was not computed for this request (reused from a cache)."""

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt tokens' log-probs of one request (asked with `prompt_logprobs`), sent once after its prefill:
    one `TokenEvent` per prompt position (`index` = position, `token_id` = the prompt token, `logprob` under the
    prefix before it; position 0 has none: NaN and no alternatives)."""

    request_id: str
    tokens: tuple[TokenEvent, ...]
    is_final: bool = False
