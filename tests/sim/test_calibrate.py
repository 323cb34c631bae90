"""`pdcluster sim calibrate`'s measured points (sim/calibrate.py), without a cluster."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from sim.calibrate import POINTS, _random_point, chunk_features


def _record(cached: int) -> SimpleNamespace:
    return SimpleNamespace(is_ok=True, cached_tokens=cached, completion_tokens=2, chunk_s=[1.0])


def test_a_point_records_its_cached_tokens() -> None:
    """The points' words share a prefix (one seed), so the prefill node serves the start of a longer point's prompt
    from its cache (the quiet run of 2026-12-05 23:34: 1,024 of ttft_w700's 3,518 tokens, 3,072 of ttft_w1200's
    6,018): the point records the mean cached tokens, and the fit prefills only the rest."""
    level = SimpleNamespace(num_ok=2, input_tokens=2 * 3518, ttft_ms=SimpleNamespace(p50=1500.0),
                            tpot_ms=SimpleNamespace(p50=None), records=[_record(1024), _record(2048)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]))
    point = next(p for p in POINTS if p.name == "ttft_w700")
    got = _random_point(real, point, Path("unused"))
    assert got["cached_tokens"] == 1536 and got["prompt_tokens"] == 3518
    steps, new_tokens, within, ctx = chunk_features(got["prompt_tokens"], None, got["cached_tokens"])
    assert (steps, new_tokens, within, ctx) == (1, 1982, 1982 * 1982 / 2, 1982 * 1536)
