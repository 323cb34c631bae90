"""A rank's engine applying the rank commands itself (engine/rank_engine.py `build_rank_engine`, `Engine.apply`,
`import_kv`, `step_events`, `rank_stats`) on one rank, no transport: commands that race an abort, a prefill
rank's export imported by a decode rank (rows copied as a NIXL read does) giving the colocated tokens under the
penalties, and what a rank reports of its load and prefix cache."""

from __future__ import annotations

import pytest

from engine.api import (
    Abort,
    EngineConfig,
    ExportedRows,
    ImportKV,
    Release,
    SamplingParams,
    StartDecode,
    Submit,
    TokenEvent,
)
from engine.model.tokenizer import ByteTokenizer
from engine.parallel.groups import ParallelContext
from engine.rank_engine import build_rank_engine
from tests.engine.test_penalties import PENALTIES, repeating_prompt


def _engine(warm_decode: bool = True):  # type: ignore[no-untyped-def]
    return build_rank_engine(EngineConfig(num_rows=8, max_batch=2), ParallelContext.single(), warm_decode=warm_decode)


def _import_kv(request_id: str, prompt: tuple[int, ...] = (1, 72, 105), first: TokenEvent | None = None,
               sampling: SamplingParams | None = None) -> ImportKV:
    return ImportKV(request_id=request_id, prompt_token_ids=prompt, sampling=sampling or SamplingParams(max_tokens=4),
                    params=None, peer=None,
                    first=first or TokenEvent(request_id=request_id, token_id=33))


def test_start_decode_after_an_abort_is_a_no_op():
    """The router's abort can reach a decode node between a request's import and its StartDecode (a client
    leaving between the legs); the StartDecode that follows must not take the rank down (it raised KeyError,
    which killed every rank of the node)."""
    engine = _engine()
    engine.import_kv(_import_kv("left"))
    assert [e.finish_reason for e in engine.apply(Abort("left"))] == ["abort"]
    assert engine.apply(StartDecode("left")) == []
    assert engine.apply(Abort("left")) == []  # nothing left to end
    engine.import_kv(_import_kv("stays"))  # the rank goes on serving
    first = engine.apply(StartDecode("stays"))
    assert [(e.request_id, e.token_id) for e in first] == [("stays", 33)]


def test_import_kv_goes_through_import_kv_only():
    """`apply(ImportKV)` would allocate rows nobody writes: the engine refuses it, naming the way."""
    with pytest.raises(ValueError, match="import_kv"):
        _engine().apply(_import_kv("r"))


def _events(engine, request_id: str, events: list | None = None) -> list:  # type: ignore[no-untyped-def]
    """Step until the request's final event; its events (those already given first)."""
    events = list(events or [])
    while not events or not events[-1].is_final:
        events += [e for e in engine.step_events() if e.request_id == request_id]
    return events


def _served(engine, request_id: str, prompt: list[int], sampling: SamplingParams) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    assert engine.apply(Submit(request_id, tuple(prompt), sampling)) == []
    return [(e.token_id, e.logprob) for e in _events(engine, request_id)]


def test_penalties_change_greedy_and_prefill_to_decode_equals_colocated():
    """What a node's ranks do with a penalised request: colocated (Submit) on a decode rank's engine, and exported
    by a prefill rank's engine then imported (ImportKV with the prompt and the prefill's first token, then
    StartDecode). The prompt makes the greedy answer repeat its first token, which the prefill side samples: the
    decode side must count it (and the prompt) to serve the colocated tokens."""
    colocated_node, prefill, decode = _engine(), _engine(warm_decode=False), _engine()
    base = ByteTokenizer().encode("Log-probs travel with every token.")
    plain = _served(colocated_node, "plain", base, SamplingParams(max_tokens=32, ignore_eos=True))
    prompt = repeating_prompt([token for token, _ in plain], base, False)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, **PENALTIES)
    colocated = _served(colocated_node, "colo", prompt, sampling)
    assert colocated != _served(colocated_node, "plain2", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    prefill.apply(Submit("pd", tuple(prompt), sampling, export=True))
    (exported,) = _events(prefill, "pd")
    assert isinstance(exported, ExportedRows) and exported.first.finish_reason == "length"
    rows = decode.import_kv(_import_kv("pd", tuple(prompt), exported.first, sampling))
    assert rows.num_reused_tokens == 0
    for src, dst in zip(exported.attn_row_ids + exported.kda_row_ids, rows.attn_row_ids + rows.kda_row_ids):
        decode.pool.buffer[dst] = prefill.pool.buffer[src]  # what a NIXL read does
    served = _events(decode, "pd", decode.apply(StartDecode("pd")))
    assert [(e.token_id, e.logprob) for e in served] == colocated
    used = prefill.rank_stats().num_rows_used
    assert used == len(exported.attn_row_ids + exported.kda_row_ids)  # the export keeps its rows until Release
    assert prefill.apply(Release("pd", exported.generation, reads_done=True)) == []
    assert prefill.rank_stats().num_rows_used == 0


def test_rank_stats_report_the_cache_once_per_change():
    """Rank 0 speaks for the node's prefix cache: its counters every round, its report only when it moved; the
    wrapper's prefill timings are taken (reported once)."""
    engine = _engine()
    first = engine.rank_stats(report_cache=True)
    assert first.cache is not None and dict(first.counters)["prefix_cache_hit_tokens"] == 0
    assert engine.rank_stats(report_cache=True).cache is None  # nothing moved
    assert engine.rank_stats().cache is None and "prefix_cache_hit_tokens" not in dict(engine.rank_stats().counters)
    _served(engine, "a", list(range(1, 40)), SamplingParams(max_tokens=2))
    moved = engine.rank_stats(report_cache=True)
    assert moved.cache is not None and not moved.has_work and moved.num_running == 0
    assert [name for name, _, _ in moved.timings] == ["prefill"]
    assert engine.rank_stats().timings == ()
