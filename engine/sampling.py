"""Sampling parameters and the per-request sampler: greedy, or seeded temperature / top-k / top-p / min-p, with
log-probs.

A request's token at output step n depends only on its logits and (seed, n): the generator is re-seeded from
both at every step, so batching, scheduling order and the rank that samples never change the result. Without an
explicit seed the seed derives from the request id (every SPMD rank draws the same token).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 = greedy (argmax, ties to the lower id)."""
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens only (0: no limit)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0: keep all)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the output text contains one (the text is cut before it)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """How many most-likely alternatives to report beside each sampled token's log-prob (None: none asked)."""
    prompt_logprobs: int | None = None
    """Log-probs of the prompt tokens (each under the prefix before it) with this many alternatives (None: none)."""

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be positive (0 only to score a prompt), got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        return self


MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per position (OpenAI's limit)."""


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    """log p(token) under the model's unscaled distribution (temperature 1, no top-p)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens with their log-probs (same distribution), most likely first, ties to the lower id."""
    rank: int = 0
    """1 + how many tokens are strictly more likely (0: not known)."""


def top_logprobs(logprobs: torch.Tensor, count: int) -> tuple[tuple[int, float], ...]:
    """The `count` largest entries of logprobs [V] as (token id, log-prob), ties broken by the lower id."""
    if count <= 0:
        return ()
    values, ids = torch.sort(logprobs, descending=True, stable=True)
    return tuple((int(i), float(v)) for i, v in zip(ids[:count], values[:count]))


def _filtered(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero the tokens top-k, top-p and min-p exclude (in that order; ties to the lower id), unnormalised."""
    if params.top_k <= 0 and params.top_p >= 1 and params.min_p <= 0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k:] = False
    if params.top_p < 1:
        kept = torch.where(keep, sorted_probs, torch.zeros(()))
        keep &= (torch.cumsum(kept, 0) - kept) < params.top_p
    if params.min_p > 0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    return torch.zeros_like(probs).scatter(0, order, torch.where(keep, sorted_probs, torch.zeros(())))


def request_seed(params: SamplingParams, request_id: str) -> int:
    return params.seed if params.seed is not None else zlib.crc32(request_id.encode())


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> SampledToken:
    """logits [V] float32 -> the token for output step `step` (sampled on the CPU wherever the logits were made:
    the CPU generator seeds it, and a GPU engine samples exactly as a CPU one given the same logits)."""
    logits = logits.cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        probs = _filtered(torch.softmax(logits / params.temperature, dim=-1), params)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
        token = int(torch.multinomial(probs, 1, generator=gen))
    chosen = logprobs[token]
    return SampledToken(token, float(chosen), top_logprobs(logprobs, params.logprobs or 0),
                        int((logprobs > chosen).sum()) + 1)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], count: int) -> list[SampledToken]:
    """logits [T, V] of a prompt's T positions -> for each prompt token after the first, its log-prob under the
    logits of the position before it, with its rank and the `count` most likely alternatives (as `sample`)."""
    logprobs = torch.log_softmax(logits[: len(prompt) - 1], dim=-1)
    out = []
    for i, token in enumerate(prompt[1:]):
        chosen = logprobs[i, token]
        out.append(SampledToken(token, float(chosen), top_logprobs(logprobs[i], count),
                                int((logprobs[i] > chosen).sum()) + 1))
    return out
