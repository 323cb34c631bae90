"""The per-request sampler over one position's logits (engine.api.SamplingParams says how): the penalties
(repetition, then frequency and presence, as vLLM applies them), then greedy or seeded temperature / top-k /
top-p / min-p; log-probs are of the raw logits (vLLM's default `raw_logprobs`).

A request's token at output step n depends only on its logits, its own tokens (prompt and the n generated
before: the penalties) and (seed, n): the generator is re-seeded from both at every step, so batching, scheduling
order, the rank that samples and the prefill/decode pairing never change the result. Without an explicit seed
the seed derives from the request id (every SPMD rank draws the same token).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.api import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    """log p(token) under the model's raw distribution (no penalties, temperature 1, no top-k/top-p/min-p)."""
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


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> torch.Tensor:
    """logits [V] -> the penalised logits [V] (`logits` itself when every penalty is off). vLLM's order: the
    repetition penalty over the tokens of the prompt and the output (a positive logit divided by it, any other
    multiplied), then the frequency penalty times each token's count in the output and the presence penalty
    once per token in the output (OpenAI's), subtracted."""
    if params.repetition_penalty == 1 and params.frequency_penalty == 0 and params.presence_penalty == 0:
        return logits
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(list(output_token_ids), dtype=torch.long), minlength=vocab)[:vocab]
    if params.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.tensor(list(prompt_token_ids), dtype=torch.long)] = True
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    present = (counts > 0).to(logits.dtype)
    return logits - params.frequency_penalty * counts.to(logits.dtype) - params.presence_penalty * present


def request_seed(params: SamplingParams, request_id: str) -> int:
    return params.seed if params.seed is not None else zlib.crc32(request_id.encode())


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int,
           prompt_token_ids: Sequence[int] = (), output_token_ids: Sequence[int] = ()) -> SampledToken:
    """logits [V] float32 -> the token for output step `step` (sampled on the CPU wherever the logits were made:
    the CPU generator seeds it, and a GPU engine samples exactly as a CPU one given the same logits).
    `prompt_token_ids` and `output_token_ids` (the `step` tokens generated before) are the request's tokens so
    far: what per-request logit processing may depend on, and nothing else (so every pairing samples alike)."""
    logits = logits.cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
    if params.temperature == 0:
        token = int(torch.argmax(scores))
    else:
        probs = _filtered(torch.softmax(scores / params.temperature, dim=-1), params)
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
