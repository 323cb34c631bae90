"""Engine: continuous batching bit-identical to running alone, sampling, stops, aborts, disaggregation, bad input."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig, TokenEvent
from engine.model.indexer import index_scores, select_topk
from engine.model.mla import QUERY_BLOCK
from engine.model.model import dequantize_context
from engine.sampling import SamplingParams
from engine.scheduler import RequestState

PROMPT_LENGTHS = (5, 40, 270, 130)  # mixed; 270 > index_topk so the indexer is selective


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(num_rows=32))


def _prompts(engine: Engine) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [[engine.tokenizer.bos_token_id] + torch.randint(0, 256, (n - 1,), generator=gen).tolist()
            for n in PROMPT_LENGTHS]


def _drain(engine: Engine, max_steps: int = 500) -> dict[str, list[TokenEvent]]:
    outputs: dict[str, list[TokenEvent]] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for out in engine.step().tokens:
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work
    return outputs


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=5, ignore_eos=True),
                                    SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=3,
                                                   ignore_eos=True)], ids=["greedy", "top-p"])
def test_mixed_batch_is_bit_identical_to_running_alone(engine: Engine, params: SamplingParams) -> None:
    """Requests of different lengths join the decode batch at different steps; tokens and log-probs are
    exactly (==) what each request gets alone."""
    free = engine.num_available_rows
    prompts = _prompts(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    batched = _drain(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        alone = _drain(engine)[f"r{i}"]
        assert [(o.token_id, o.logprob) for o in alone] == [(o.token_id, o.logprob) for o in batched[f"r{i}"]]
        assert alone[-1].finish_reason == "length" and len(alone) == 5
    assert engine.num_available_rows == free


def test_indexer_selections_identical_batched_and_single(engine: Engine) -> None:
    """The selections of a block of prefill queries equal those of each query scored alone."""
    prompt = torch.tensor(_prompts(engine)[2])
    mla = engine.model.layers[3].mixer
    cache_table = engine.pool.allocate_request(len(prompt))
    try:
        from engine.cache import RowSequenceCache

        cache = RowSequenceCache(engine.pool, cache_table)
        with torch.no_grad():
            engine.model.prefill(prompt, cache)
            h = torch.randn(QUERY_BLOCK, engine.model_config.d_model)
            proj = mla.project(h)
        ctx = dequantize_context(cache.read_attention(0, len(prompt)), mla)
        positions = torch.arange(len(prompt) - QUERY_BLOCK, len(prompt))
        topk = engine.model_config.index_topk
        block = select_topk(index_scores(proj.index_queries.q, proj.index_queries.weights, ctx.index_keys,
                                         ctx.index_scale), positions, topk)
        for i in (0, 17, QUERY_BLOCK - 1):
            n = int(positions[i]) + 1
            single = select_topk(index_scores(proj.index_queries.q[i : i + 1], proj.index_queries.weights[i : i + 1],
                                              ctx.index_keys[:n], ctx.index_scale[:n]), positions[i : i + 1], topk)
            assert torch.equal(single[0], block[i])
        assert (block[-1] >= 0).sum() == topk  # the last query really selects (270 > 256 keys)
    finally:
        engine.pool.free(cache_table.row_ids)


def test_prefill_export_then_import_decode_equals_colocated(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = _prompts(engine)[2]
    engine.add_request("colo", prompt, params)
    colocated = [(o.token_id, o.logprob) for o in _drain(engine)["colo"]]
    free = engine.num_available_rows
    res = engine.prefill_and_keep("p1", prompt, params)
    assert res.num_tokens == len(prompt) and (res.first_token, res.first_logprob) == colocated[0]
    assert engine.request_state("p1") == RequestState.EXPORTED
    decoder = Engine(EngineConfig(num_rows=16))
    table = decoder.allocate_for_import("p1", prompt, params)
    for src, dst in zip(res.attn_row_ids + res.kda_row_ids, table.attn_row_ids + table.kda_row_ids):
        decoder.pool.buffer[dst] = engine.pool.buffer[src]  # what a NIXL read does
    outs = decoder.start_decode("p1", res.first_token, res.first_logprob) + _drain(decoder).get("p1", [])
    assert [(o.token_id, o.logprob) for o in outs] == colocated
    assert engine.release("p1", res.generation, reads_done=True) and engine.num_available_rows == free + 0
    assert decoder.num_available_rows == 16


def test_queued_export_returns_prefill_result(engine: Engine) -> None:
    free = engine.num_available_rows
    engine.add_request("q1", _prompts(engine)[0], SamplingParams(max_tokens=8), export=True)
    out = engine.step()
    assert [r.request_id for r in out.exported] == ["q1"] and not out.tokens and not engine.has_work
    generation = out.exported[0].generation
    assert not engine.release("q1", generation + 1, reads_done=True)  # another export's generation frees nothing
    assert engine.release("q1", generation, reads_done=True) and engine.num_available_rows == free
    assert not engine.release("q1", generation, reads_done=True)


def test_stops_and_abort_free_rows(engine: Engine) -> None:
    free = engine.num_available_rows
    prompt = _prompts(engine)[1]
    engine.add_request("g", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    greedy = [o.token_id for o in _drain(engine)["g"]]
    engine.add_request("s", prompt, SamplingParams(max_tokens=6, stop_token_ids=(greedy[2],)))
    stopped = _drain(engine)["s"]
    assert [o.token_id for o in stopped] == greedy[: greedy.index(greedy[2]) + 1]
    assert stopped[-1].finish_reason == "stop"
    text = engine.tokenizer.decode(greedy[:3])
    if text:  # the stop string path needs a printable byte among the first tokens
        engine.add_request("t", prompt, SamplingParams(max_tokens=6, stop=(text[-1],), ignore_eos=True))
        assert _drain(engine)["t"][-1].finish_reason == "stop"
    engine.add_request("a", prompt, SamplingParams(max_tokens=50))
    engine.add_request("b", prompt, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a")
    assert not engine.has_work and engine.num_available_rows == free


@pytest.mark.parametrize("prompt,params,match", [
    ([], {}, "empty"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2000], {}, "out of range"),
    ([1] * 32760, {"max_tokens": 10}, "maximum context length"),
    ([1], {"top_p": 0}, "top_p"),
], ids=["empty", "max-tokens", "token-range", "too-long", "top-p"])
def test_bad_input_is_rejected(engine: Engine, prompt: list[int], params: dict, match: str) -> None:
    """Bad sampling values are refused where SamplingParams is built (a ValueError naming the field), the rest
    by add_request."""
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert not engine.has_work


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        Engine(EngineConfig(model="kimi-k9"))
