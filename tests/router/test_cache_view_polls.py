"""`CacheView.apply_report` against the plain rebuild it replaces (`_naive_apply_report`: every poll rebuilds an
instance's table and looks through all old entries), over random sequences of polls and turn-end notes with
polls in flight while notes arrive, equal timestamps, and tables full enough that notes evict (a small
MAX_SESSIONS). The tables must match entry for entry and in order: a full table evicts its first oldest entry."""

from __future__ import annotations

import random

import pytest

from router import cache_view
from router.cache_view import CacheReport, CacheView, _Instance


def _naive_apply_report(view: CacheView, instance: str, report: CacheReport, sent_at: float) -> None:
    current = view._instances.get(instance)
    held = {s: (t, sent_at) for s, t in report.sessions.items()}
    notes: dict[str, tuple[int, float]] = {}
    if current is not None:
        for session, (tokens, at) in current.held.items():
            if at > sent_at and len(held) < cache_view.MAX_SESSIONS:
                held[session] = (tokens, at)
        notes = {s: n for s, n in current.resumable.items() if n[1] > sent_at}
    view._instances[instance] = _Instance(report, held, notes)


def _report(rng: random.Random, names: list[str]) -> CacheReport:
    chosen = rng.sample(names, rng.randint(0, len(names)))
    sessions = {s: rng.randint(1, 500) for s in chosen}
    resumable = {s: rng.randint(1, t) for s, t in sessions.items() if rng.random() < 0.7}
    return CacheReport(block_tokens=16, sessions=sessions, resumable=resumable, blocks_cached=len(sessions) + 1,
                       tails=rng.random() < 0.8)


def _state(view: CacheView) -> list:
    return [(name, inst.report, list(inst.held.items()), list(inst.resumable.items()))
            for name, inst in view._instances.items()]


@pytest.mark.parametrize("seed", range(8))
def test_polls_and_notes_match_the_plain_rebuild(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_view, "MAX_SESSIONS", 6)
    rng = random.Random(seed)
    names = [f"{k:02x}" for k in range(10)]
    fast, naive = CacheView(), CacheView()
    now, in_flight = 0.0, {}
    for _ in range(600):
        instance = rng.choice(("a", "b"))
        op = rng.random()
        if op < 0.25:  # a poll is sent now and answers later (notes may arrive meanwhile)
            in_flight.setdefault(instance, (now, _report(rng, names)))
        elif op < 0.45 and instance in in_flight:
            sent_at, report = in_flight.pop(instance)
            fast.apply_report(instance, report, sent_at)
            _naive_apply_report(naive, instance, report, sent_at)
        else:
            session, tokens = rng.choice(names), rng.randint(0, 600)
            resumable = rng.choice((0, tokens, max(0, tokens - 1)))
            fast.note_served(instance, session, tokens, now, resumable)
            naive.note_served(instance, session, tokens, now, resumable)
        if rng.random() < 0.6:  # else the next event happens at the same time
            now += rng.choice((0.1, 0.5, 1.0))
        assert _state(fast) == _state(naive)
        for session in names:
            assert fast.held(session) == naive.held(session)
            assert fast.resumable(session) == naive.resumable(session)
