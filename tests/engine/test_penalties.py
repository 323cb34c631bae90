"""Presence, frequency and repetition penalties: the math against hand-written logits, the sampler (greedy too)
choosing from the penalised logits while reporting raw log-probs, the ranges, and on the engine a prefill ->
import -> decode that gives the colocated tokens (the penalties depend only on the request's own tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.api import SamplingParams, SamplingParamsError
from engine.engine import Engine, EngineConfig
from engine.model.tokenizer import ByteTokenizer
from engine.sampling import apply_penalties, sample

PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def _penalised(logits: list[float], prompt: list[int], output: list[int], **penalties: float) -> list[float]:
    return apply_penalties(torch.tensor(logits), SamplingParams(**penalties), prompt, output).tolist()


def test_repetition_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens() -> None:
    logits = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
    assert _penalised(logits, [0, 1, 5], [2], repetition_penalty=2.0) == [1.0, -2.0, 0.25, -0.5, 1.0, 0.0]
    assert _penalised(logits, [0, 1, 5], [2], repetition_penalty=0.5) == [4.0, -0.5, 1.0, -0.5, 1.0, 0.0]


def test_frequency_and_presence_count_generated_tokens_only() -> None:
    logits = [2.0, -1.0, 0.5, -0.5, 1.0]
    # token 2 generated twice, token 3 once; the prompt's tokens 0 and 1 are not penalised
    assert _penalised(logits, [0, 1], [2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25) == [
        2.0, -1.0, 0.5 - 2 * 0.5 - 0.25, -0.5 - 0.5 - 0.25, 1.0]
    assert _penalised(logits, [0, 1], [2, 2, 3], frequency_penalty=-0.5, presence_penalty=-1.0) == [
        2.0, -1.0, 0.5 + 1.0 + 1.0, -0.5 + 0.5 + 1.0, 1.0]


def test_repetition_comes_before_frequency_and_presence() -> None:
    # vLLM's order: (2 / 2) - 2 * 0.5 - 0.25 = -0.25 (the other order would give (2 - 1.25) / 2 = 0.375)
    assert _penalised([2.0, 1.0], [], [0, 0], repetition_penalty=2.0, frequency_penalty=0.5,
                      presence_penalty=0.25) == [-0.25, 1.0]


def test_neutral_penalties_leave_the_logits_alone() -> None:
    logits = torch.tensor([1.0, 2.0])
    assert apply_penalties(logits, SamplingParams(), [0, 1], [1, 1]) is logits


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1, "seed": 3}],
                         ids=["greedy", "sampled-top-k-1"])
def test_the_sampler_chooses_from_penalised_logits_and_reports_raw_logprobs(params: dict) -> None:
    logits = torch.tensor([3.0, 2.5, 0.0])
    raw = torch.log_softmax(logits, dim=-1)
    assert sample(logits, SamplingParams(**params), 0, 1, [7], [0]).token_id == 0
    for penalties, prompt, output in (({"presence_penalty": 1.0}, [7], [0]), ({"frequency_penalty": 1.0}, [7], [0]),
                                      ({"repetition_penalty": 1.5}, [0], [])):
        token = sample(logits, SamplingParams(**params, **penalties), 0, len(output), prompt, output)
        assert token.token_id == 1, penalties  # 3.0 - 1 (or 3.0 / 1.5) < 2.5
        assert token.logprob == float(raw[1]) and token.rank == 2


@pytest.mark.parametrize("name,value,ok", [
    ("presence_penalty", 2.0, True), ("presence_penalty", -2.0, True), ("presence_penalty", 2.5, False),
    ("presence_penalty", math.nan, False), ("frequency_penalty", -2.01, False), ("frequency_penalty", 1.5, True),
    ("repetition_penalty", 0.0, False), ("repetition_penalty", -1.0, False), ("repetition_penalty", 0.01, True),
    ("repetition_penalty", 3.0, True),
], ids=lambda v: str(v))
def test_ranges_are_vllms(name: str, value: float, ok: bool) -> None:
    if ok:
        assert getattr(SamplingParams(**{name: value}), name) == value
        return
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name and name in str(info.value)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(num_rows=32))


def _greedy(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, **penalties: float) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **penalties)
    return engine.generate(request_id, prompt, params).token_ids


def repeating_prompt(plain: list[int], prompt: list[int], with_repeated: bool) -> list[int]:
    """`prompt` + the plain greedy answer `plain` up to the first token it later repeats (`with_repeated`: and
    that token), so that token comes back in this prompt's answer: as its first token, or after it is in the
    prompt (the model answers noise: the repeat is found, not assumed)."""
    again = next(i for i, token in enumerate(plain) if token in plain[:i])
    return prompt + plain[: plain.index(plain[again]) + with_repeated]


@pytest.mark.parametrize("repeated,penalties", [("first-token", PENALTIES),
                                                ("prompt-token", {"repetition_penalty": 1.3})],
                         ids=["first-token", "prompt-token"])
def test_penalties_change_greedy_and_a_prefill_to_decode_pairing_equals_colocated(
        engine: Engine, repeated: str, penalties: dict) -> None:
    """The repeated token is the first one (sampled by the prefill side) or a prompt token: the decode side must
    count the first token, and know the prompt, to penalise as a colocated run does."""
    base = ByteTokenizer().encode("Log-probs travel with every token.")
    prompt = repeating_prompt(_greedy(engine, "plain", base, 32), base, repeated == "prompt-token")
    params = SamplingParams(max_tokens=24, ignore_eos=True, **penalties)
    colocated = engine.generate("colo", prompt, params)
    assert colocated.token_ids != _greedy(engine, "plain2", prompt, 24)
    res = engine.prefill_and_keep("pd", prompt, params)
    decoder = Engine(EngineConfig(num_rows=16))
    table = decoder.allocate_for_import("pd", prompt, params)
    for src, dst in zip(res.attn_row_ids + res.kda_row_ids, table.attn_row_ids + table.kda_row_ids):
        decoder.pool.buffer[dst] = engine.pool.buffer[src]  # what a NIXL read does
    events = decoder.start_decode("pd", res.first_token, res.first_logprob)
    while decoder.has_work:
        events += decoder.step().tokens
    assert [(e.token_id, e.logprob) for e in events] == list(zip(colocated.token_ids, colocated.logprobs))
    assert engine.release("pd", res.generation, reads_done=True)
