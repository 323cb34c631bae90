"""Zero mismatch on one rank: the log-prob served for every generated token equals, bit for bit, that token's
prompt log-prob when prompt + answer is scored again (teacher forcing through the prefill path, max_tokens=0)."""

from __future__ import annotations

import math

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams

PROMPT_LENGTHS = (5, 63, 64, 65, 300)
"""Around the KDA chunk length and the DSA top-k (256 in kimi-k3.1-mini): prefill and decode agree on all."""


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [256] + [(i * 37 + salt) % 251 for i in range(n - 1)]


def _score(engine: Engine, request_id: str, tokens: list[int], count: int = 0) -> list:
    engine.add_request(request_id, tokens, SamplingParams(max_tokens=0, prompt_logprobs=count))
    scored, finished = None, False
    while not finished:
        out = engine.step()
        scored = next((p for p in out.prompt_logprobs if p.request_id == request_id), scored)
        finished = any(t.request_id == request_id and t.finish_reason == "length" and t.token_id is None
                       for t in out.tokens)
    assert scored is not None
    return list(scored.tokens)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=96))


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_served_logprobs_equal_teacher_forced(engine: Engine, length: int, temperature: float) -> None:
    prompt = _prompt(length)
    served = engine.generate(f"g{length}-{temperature}", prompt,
                             SamplingParams(max_tokens=8, temperature=temperature, seed=11, ignore_eos=True))
    scored = _score(engine, f"s{length}-{temperature}", prompt + served.token_ids)
    assert math.isnan(scored[0].logprob) and not scored[0].top_logprobs
    assert [e.token_id for e in scored] == prompt + served.token_ids
    assert [e.logprob for e in scored[length:]] == served.logprobs  # exact float equality


def test_concurrent_batch_equals_teacher_forced(engine: Engine) -> None:
    """Requests decoding together (different lengths, one batch) still match their own scoring pass."""
    prompts = {f"c{i}": _prompt(n, salt=i) for i, n in enumerate((40, 129, 70, 200))}
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, sampling)
    served: dict[str, list] = {rid: [] for rid in prompts}
    while engine.has_work:
        for event in engine.step().tokens:
            served[event.request_id].append(event)
    for request_id, prompt in prompts.items():
        answer = [e.token_id for e in served[request_id]]
        scored = _score(engine, f"score-{request_id}", prompt + answer)
        assert [e.logprob for e in scored[len(prompt):]] == [e.logprob for e in served[request_id]]


def test_top_alternatives_and_prompt_logprobs_leave_sampling_unchanged(engine: Engine) -> None:
    prompt = _prompt(90)
    plain = engine.generate("plain", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=5))
    asked = engine.generate("asked", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=5, logprobs=4,
                                                            prompt_logprobs=2))
    assert (asked.token_ids, asked.logprobs) == (plain.token_ids, plain.logprobs)
    greedy = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=16))
    greedy.add_request("top", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    events = []
    while greedy.has_work:
        events += greedy.step().tokens
    for event in events:
        assert len(event.top_logprobs) == 3
        assert event.top_logprobs[0] == (event.token_id, event.logprob)
        values = [lp for _, lp in event.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_zero_max_tokens_needs_prompt_logprobs(engine: Engine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("nothing", _prompt(10), SamplingParams(max_tokens=0))


def test_top_k_and_min_p_restrict_what_is_sampled() -> None:
    """top_k=1 and min_p=1 both leave only the most likely token: sampling at any temperature is greedy."""
    engine = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=16))
    prompt = _prompt(50)
    greedy = engine.generate("greedy", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for name, extra in (("k", {"top_k": 1}), ("p", {"min_p": 1.0})):
        hot = engine.generate(f"hot-{name}", prompt, SamplingParams(max_tokens=6, temperature=1.5, seed=9,
                                                                    ignore_eos=True, **extra))
        assert hot.token_ids == greedy.token_ids
    free = engine.generate("free", prompt, SamplingParams(max_tokens=6, temperature=1.5, seed=9, ignore_eos=True))
    assert free.token_ids != greedy.token_ids  # the restriction, not the seed, made them greedy
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
