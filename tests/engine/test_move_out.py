"""`MoveOut` (a draining decode node's planned move, decode_node/moves.py): the running request's next decode step
exports it instead of streaming the token it samples; another engine that imports those rows (prompt + outputs
so far, the sampled token first) continues the stream bit for bit, greedy and seeded; the export's release frees
every row; a request that is not decoding is left alone."""

from __future__ import annotations

import pytest

from engine.api import ExportedRows, MoveOut, SamplingParams, Submit, TokenEvent
from engine.engine import Engine, EngineConfig
from engine.model.tokenizer import ByteTokenizer

CASES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 99}}
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(num_rows=48))


def _prompt() -> list[int]:
    return ByteTokenizer().encode("A stream moved with its KV to another decode instance.")


def _run_until(engine: Engine, request_id: str, num_tokens: int) -> list[TokenEvent]:
    tokens: list[TokenEvent] = []
    while len(tokens) < num_tokens:
        tokens += [e for e in engine.step_events() if isinstance(e, TokenEvent) and e.request_id == request_id]
    return tokens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_sent", [1, 6])
def test_a_moved_stream_continues_on_the_reader_bit_for_bit(engine: Engine, case: str, num_sent: int) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2, **CASES[case])
    whole = engine.generate(f"whole-{case}-{num_sent}", _prompt(), params)
    free_before = engine.num_free_rows
    rid = f"moved-{case}-{num_sent}"
    engine.apply(Submit(request_id=rid, prompt_token_ids=tuple(_prompt()), sampling=params))
    sent = _run_until(engine, rid, num_sent)
    assert [e.token_id for e in sent] == whole.token_ids[:num_sent]
    assert engine.apply(MoveOut(request_id=rid)) == []
    events = engine.step_events()
    assert not [e for e in events if isinstance(e, TokenEvent) and e.request_id == rid]  # not streamed here
    exported = next(e for e in events if isinstance(e, ExportedRows) and e.request_id == rid)
    tokens = _prompt() + [int(e.token_id) for e in sent]
    assert exported.num_tokens == len(tokens)
    assert len(exported.attn_row_ids) == -(-len(tokens) // engine.layout.block_size)
    assert exported.first.token_id == whole.token_ids[num_sent]

    reader = Engine(EngineConfig(num_rows=24))
    resumed = SamplingParams(max_tokens=NUM_TOKENS - num_sent, ignore_eos=True, logprobs=2, num_resumed=num_sent,
                             **CASES[case])
    table = reader.allocate_for_import(rid, tokens, resumed)
    for src, dst in zip(exported.attn_row_ids + exported.kda_row_ids, table.attn_row_ids + table.kda_row_ids):
        reader.pool.buffer[dst] = engine.pool.buffer[src]  # what the reader's NIXL READ does
    rest = reader.start_decode(rid, int(exported.first.token_id), exported.first.logprob,
                               exported.first.top_logprobs)
    while reader.has_work:
        rest += reader.step().tokens
    assert [e.token_id for e in rest] == whole.token_ids[num_sent:]
    assert [e.logprob for e in rest] == whole.logprobs[num_sent:]
    assert engine.release(rid, exported.generation, reads_done=True)
    assert engine.num_free_rows == free_before


def test_a_queued_request_moves_at_its_first_decode_step(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.apply(Submit(request_id="queued", prompt_token_ids=tuple(_prompt()), sampling=params))
    assert engine.apply(MoveOut(request_id="queued")) == []  # waiting: it moves once it decodes
    assert engine.apply(MoveOut(request_id="unknown")) == []
    events = []
    while engine.has_work:
        events += engine.step_events()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    exported = [e for e in events if isinstance(e, ExportedRows)]
    assert len(tokens) == 1 and not tokens[0].finish_reason  # the prefill's token, then the move
    assert len(exported) == 1 and exported[0].num_tokens == len(_prompt()) + 1
    assert engine.release("queued", exported[0].generation, reads_done=True)


def test_a_request_that_ends_before_its_move_is_not_moved(engine: Engine) -> None:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.apply(Submit(request_id="short", prompt_token_ids=tuple(_prompt()), sampling=params))
    engine.apply(MoveOut(request_id="short"))
    events = []
    while engine.has_work:
        events += engine.step_events()
    assert [e.finish_reason for e in events if isinstance(e, TokenEvent)] == ["length"]
    assert not [e for e in events if isinstance(e, ExportedRows)] and not engine._moving
