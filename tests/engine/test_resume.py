"""A resumed request (the prompt plus the tokens a lost stream already sent, `num_resumed` of them) continues
that stream bit for bit: greedy, seeded sampling, penalties (which count the resumed tokens as output), on the
colocated path and through a prefill -> import -> decode pairing."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams, SamplingParamsError
from engine.engine import Engine, EngineConfig
from engine.model.tokenizer import ByteTokenizer

CASES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "seed": 1234},
    "seeded-penalties": {"temperature": 0.8, "top_p": 0.9, "seed": 7, "presence_penalty": 1.0,
                         "frequency_penalty": 0.5, "repetition_penalty": 1.2},
}
NUM_TOKENS = 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(num_rows=32))


def _prompt() -> list[int]:
    return ByteTokenizer().encode("A stream that survives its decode instance.")


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("num_sent", [1, 7])
def test_a_resumed_request_draws_the_lost_streams_next_tokens(engine: Engine, case: str, num_sent: int) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **CASES[case])
    whole = engine.generate(f"whole-{case}-{num_sent}", _prompt(), params)
    resumed_params = SamplingParams(max_tokens=NUM_TOKENS - num_sent, ignore_eos=True, num_resumed=num_sent,
                                    **CASES[case])
    # another request id: the seed is explicit or greedy, so the id must not matter
    rest = engine.generate(f"rest-{case}-{num_sent}", _prompt() + whole.token_ids[:num_sent], resumed_params)
    assert rest.token_ids == whole.token_ids[num_sent:]
    assert rest.logprobs == whole.logprobs[num_sent:]


@pytest.mark.parametrize("case", ["seeded", "seeded-penalties"])
def test_a_resumed_request_through_a_prefill_decode_pairing(engine: Engine, case: str) -> None:
    """The prefill side samples the resumed request's first token at the right step (it knows `num_resumed`)."""
    num_sent = 5
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **CASES[case])
    whole = engine.generate(f"pd-whole-{case}", _prompt(), params)
    prompt = _prompt() + whole.token_ids[:num_sent]
    resumed = SamplingParams(max_tokens=NUM_TOKENS - num_sent, ignore_eos=True, num_resumed=num_sent,
                             **CASES[case])
    res = engine.prefill_and_keep(f"pd-{case}", prompt, resumed)
    decoder = Engine(EngineConfig(num_rows=16))
    table = decoder.allocate_for_import(f"pd-{case}", prompt, resumed)
    for src, dst in zip(res.attn_row_ids + res.kda_row_ids, table.attn_row_ids + table.kda_row_ids):
        decoder.pool.buffer[dst] = engine.pool.buffer[src]  # what a NIXL read does
    events = decoder.start_decode(f"pd-{case}", res.first_token, res.first_logprob)
    while decoder.has_work:
        events += decoder.step().tokens
    assert [e.token_id for e in events] == whole.token_ids[num_sent:]
    assert engine.release(f"pd-{case}", res.generation, reads_done=True)


def test_num_resumed_is_checked() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(num_resumed=-1)
    assert info.value.field == "num_resumed"
    with pytest.raises(ValueError, match="num_resumed"):
        Engine(EngineConfig(num_rows=8)).add_request("r", [1, 2], SamplingParams(num_resumed=2))
