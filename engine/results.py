"""What an engine hands back: `StepOutputs` of one step (token events, exports, prompt log-probs), a
`PrefillResult` per export (its rows and first token; `event()` is the rank event that reports it), a
`GenerationResult` of `Engine.generate`, and the `CacheReport` a node's /v1/cache answers. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.api import ExportedRows
from engine.outputs import PromptLogprobs, TokenEvent


@dataclass(frozen=True)
class CacheReport:
    """What the node's /v1/cache answers (docs/SESSIONS.md)."""

    block_tokens: int
    fingerprint: str
    sessions: tuple[tuple[str, int], ...]
    """(session, leading tokens of its last turn held), most recently used first."""
    resumable: tuple[tuple[str, int], ...]
    """(session, leading tokens a local prefill could resume from: held and ending in a KDA snapshot, or the
    end of the session's last turn while its tail is held)."""
    blocks_cached: int
    rows_free: int
    hits_tokens: int
    queried_tokens: int
    evicted_blocks: int
    blocks_read: int
    blocks_reused: int
    tails: bool = False
    """Finished turns leave a tail (resumable at their exact end): the cache is on and prefills can resume."""


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    attn_row_ids: tuple[int, ...]
    kda_row_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    first_logprob: float
    generation: int = 0
    """Names this export for `release` (unique within the engine)."""
    first_top_logprobs: tuple[tuple[int, float], ...] = ()
    """Alternatives to the first token, as many as the request asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens reused from this engine's prefix cache (not computed)."""

    def event(self) -> ExportedRows:
        """The rank event that reports this export (its first token finishes the prefill leg: "length")."""
        first = TokenEvent(request_id=self.request_id, token_id=self.first_token, logprob=self.first_logprob,
                           top_logprobs=self.first_top_logprobs, finish_reason="length",
                           num_prompt_tokens=self.num_tokens, num_cached_tokens=self.num_cached_tokens)
        return ExportedRows(request_id=self.request_id, attn_row_ids=self.attn_row_ids, kda_row_ids=self.kda_row_ids,
                            num_tokens=self.num_tokens, first=first, num_cached_tokens=self.num_cached_tokens,
                            generation=self.generation)


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class StepOutputs:
    tokens: list[TokenEvent] = field(default_factory=list)
    exported: list[PrefillResult] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
