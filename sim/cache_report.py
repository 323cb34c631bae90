"""A simulated node's `/v1/cache` report, kept up to date per session instead of recomputed whole every poll.

`Engine.cache_report` walks the block keys of every remembered session (up to 1024) on each poll; a simulated hour
of eight instances polled every second would spend most of its time there. The figures per session
(`PrefixCache.held_figures`: `held_tokens`, plain and with snapshots and tails) change only when the session's own
record changes or when one of its blocks or tails is inserted, evicted or loses its snapshot. `ObservedPrefixCache`
is the real PrefixCache whose block and tail tables note the keys and tails that change; `SessionReports`
recomputes, with the real `held_figures`, only the sessions those touch. tests/sim checks the report against the full recomputation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from engine.prefix_cache import ROOT, CachedBlock, PrefixCache


class _NotedDict(dict):
    """A dict that notes every key set or deleted into `changed`."""

    def __init__(self, changed: set) -> None:
        super().__init__()
        self.changed = changed

    def __setitem__(self, key, value) -> None:  # noqa: ANN001
        self.changed.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:  # noqa: ANN001
        self.changed.add(key)
        super().__delitem__(key)


class _NotedOrderedDict(OrderedDict):
    """An OrderedDict that notes every key removed into `changed` (tails leave by `pop` or `del`)."""

    def __init__(self, changed: set) -> None:
        super().__init__()
        self.changed = changed

    def pop(self, key, *default):  # noqa: ANN001, ANN201
        self.changed.add(key)
        return super().pop(key, *default)

    def __delitem__(self, key) -> None:  # noqa: ANN001
        self.changed.add(key)
        super().__delitem__(key)


class ObservedPrefixCache(PrefixCache):
    def __init__(self, pool, block_tokens: int, fingerprint: bytes, enabled: bool = True) -> None:  # noqa: ANN001
        super().__init__(pool, block_tokens, fingerprint, enabled)
        self.changed_keys: set[bytes] = set()
        self.changed_tails: set[int] = set()
        self.blocks = _NotedDict(self.changed_keys)
        self.tails = _NotedOrderedDict(self.changed_tails)

    def keys(self, tokens: Sequence[int], num_blocks: int, root: bytes = ROOT) -> list[bytes]:
        """`PrefixCache.keys`, remembered on the prompt when it is a `TokenRuns` (sim/tokens.py `chained_keys`)."""
        chained = getattr(tokens, "chained_keys", None)
        if chained is None:
            return super().keys(tokens, num_blocks, root)
        return chained(self.block_tokens, num_blocks, self.fingerprint, root)

    def insert(self, key: bytes, index: int, attn_row: int, kda_rows: tuple[int, ...] | None) -> CachedBlock | None:
        held = self.blocks.get(key)
        if held is not None and held.kda_rows is None and kda_rows is not None:
            self.changed_keys.add(key)  # a held block gains its snapshot (a new block is noted by `blocks`)
        return super().insert(key, index, attn_row, kda_rows)

    def drop_snapshot(self, block: CachedBlock) -> None:
        self.changed_keys.add(block.key)
        super().drop_snapshot(block)


def common_prefix(a: list[bytes], b: list[bytes]) -> int:
    """How many leading keys two chains of block keys share. A chained key names its whole prefix
    (engine/prefix_cache.py `chain_keys`), so equal keys at k mean equal keys before k: a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SessionReports:
    """Per session: (held tokens, resumable tokens), recomputed when something it depends on changed."""

    def __init__(self, cache: ObservedPrefixCache) -> None:
        self.cache = cache
        self.figures: dict[str, tuple[int, int]] = {}
        self._by_key: dict[bytes, set[str]] = {}
        self._by_tail: dict[int, set[str]] = {}
        self._dirty: set[str] = set()
        self._moved: set[str] = set()
        """Sessions remembered since the last report (they lead the next one)."""
        self._forgotten: set[str] = set()
        self._last: tuple[dict[str, int], dict[str, int]] | None = None
        """The last report's (held, resumable) maps, most recent session first; never changed once handed out."""

    def remember(self, session: str, old: tuple[list[bytes], list] | None, keys: list[bytes], tails: list) -> None:
        """The session's record is now (keys, tails): index what it did not have (a turn's keys extend the last
        turn's, so only the keys past their common prefix change)."""
        kept = 0
        if old is not None:
            kept = common_prefix(old[0], keys)
            self._unindex(session, old[0][kept:], old[1])
        for key in keys[kept:]:
            self._by_key.setdefault(key, set()).add(session)
        for tail in tails:
            self._by_tail.setdefault(id(tail), set()).add(session)
        self._dirty.add(session)
        self._moved.add(session)

    def forget(self, session: str, old: tuple[list[bytes], list]) -> None:
        self._unindex(session, *old)
        self.figures.pop(session, None)
        self._dirty.discard(session)
        self._forgotten.add(session)

    def _unindex(self, session: str, keys: list[bytes], tails: list) -> None:
        for key in keys:
            found = self._by_key.get(key)
            if found is not None:
                found.discard(session)
                if not found:
                    del self._by_key[key]
        for tail in tails:
            found = self._by_tail.get(id(tail))
            if found is not None:
                found.discard(session)
                if not found:
                    del self._by_tail[id(tail)]

    def refresh(self, sessions: OrderedDict) -> set[str]:
        """Recompute the sessions whose blocks, tails or records changed since the last refresh; returns those whose
        figures changed."""
        cache = self.cache
        dirty = self._dirty
        for key in cache.changed_keys:
            dirty.update(self._by_key.get(key, ()))
        for tail in cache.changed_tails:
            dirty.update(self._by_tail.get(tail, ()))
        cache.changed_keys.clear()
        cache.changed_tails.clear()
        changed = set()
        figures = self.figures
        for session in dirty:
            record = sessions.get(session)
            if record is not None:
                keys, tails = record
                now = cache.held_figures(keys, tails)
                if figures.get(session) != now:
                    figures[session] = now
                    changed.add(session)
        dirty.clear()
        return changed

    def report(self, sessions: OrderedDict) -> tuple[dict[str, int], dict[str, int]]:
        """(held, resumable): session -> tokens, sessions with none left out, most recently remembered first (as
        `Engine.cache_report` lists them). Built from the last report's maps: the sessions remembered since lead,
        the ones whose figures changed are set in place, forgotten ones dropped; a session whose figure rose from
        none without being remembered belongs somewhere in the middle, and the maps are then built whole."""
        changed = self.refresh(sessions)
        moved = [s for s in self._moved if s in sessions]
        last, figures = self._last, self.figures
        maps = None
        if last is not None:
            front = list(islice(reversed(sessions), len(moved)))  # the remembered ones are the newest
            changed.difference_update(moved)
            gone = [s for s in self._forgotten if s not in sessions]
            maps = tuple(_patched(last[i], i, front, changed, gone, figures) for i in (0, 1))
        if maps is None or maps[0] is None or maps[1] is None:
            recent = [(s, figures[s]) for s in reversed(sessions)]
            maps = ({s: f[0] for s, f in recent if f[0] > 0}, {s: f[1] for s, f in recent if f[1] > 0})
        self._moved.clear()
        self._forgotten.clear()
        self._last = maps
        return maps


def _patched(last: dict[str, int], i: int, front: list[str], changed: set[str], gone: list[str],
             figures: dict[str, tuple[int, int]]) -> dict[str, int] | None:
    """`last` with `front` leading (in that order), `changed` set in place and `gone` dropped; None when a changed
    session is missing from `last` (its place is not known here)."""
    new = {s: figures[s][i] for s in front}
    new.update(last)  # the front keep their places (their stale values are set again below)
    for s in front:
        value = figures[s][i]
        if value > 0:
            new[s] = value
        else:
            del new[s]
    for s in gone:
        new.pop(s, None)
    for s in changed:
        value = figures[s][i]
        if value > 0:
            if s not in new:
                return None
            new[s] = value
        else:
            new.pop(s, None)
    return new
