"""loadgen reads the usage's `prompt_tokens_details.cached_tokens` into each record, sums it per level and
shows the prompt cache hit ratio in `loadgen compare`."""

from __future__ import annotations

import json

from loadgen.client import _consume, _Stream
from loadgen.metrics import summarize_level
from loadgen.records import RequestRecord
from loadgen.slo import SLO


def record(rid: str, prompt: int, cached: int | None) -> RequestRecord:
    return RequestRecord(request_id=rid, concurrency=1, outcome="ok", start_s=0.0, end_s=1.0, chunk_s=[0.5],
                         prompt_tokens=prompt, completion_tokens=1, output_tokens=1, cached_tokens=cached,
                         ttft_s=0.5, e2e_s=1.0)


def test_usage_cached_tokens_are_read():
    state = _Stream()
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}}
    _consume(json.dumps({"choices": [], "usage": usage}), "chat", state, 1.0)
    assert (state.prompt_tokens, state.cached_tokens) == (100, 64)
    bare = _Stream()
    _consume(json.dumps({"choices": [], "usage": {"prompt_tokens": 5}}), "chat", bare, 1.0)
    assert bare.cached_tokens is None


def test_level_hit_ratio_counts_only_requests_that_report():
    level = summarize_level(1, [record("a", 100, 80), record("b", 100, 0), record("c", 50, None)], 1.0, SLO())
    assert (level.cached_tokens, level.prompt_cache_hit_ratio) == (80, 0.4)
    none = summarize_level(1, [record("c", 50, None)], 1.0, SLO())
    assert (none.cached_tokens, none.prompt_cache_hit_ratio) == (None, None)
