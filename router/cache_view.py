"""What each node's prefix cache holds per session, as the router knows it (docs/SESSIONS.md).

Two sources, both bounded:
- polls: `CachePoller` reads every healthy instance's `GET /v1/cache` each `cache_poll_interval_s` (one request
  per instance per round, a timeout, a body cap; an instance that answered 404, vLLM, is asked again only after
  `NO_ENDPOINT_SKIP_ROUNDS` rounds or a return from unhealthy); `parse_report` keeps at most `MAX_SESSIONS`
  entries whose keys are hex strings of at most 64 characters (anything else is dropped: a node answer
  never grows a table without bound). A node without the endpoint (vLLM) just has no report.
- responses: when a turn ends, the decode instance that served it holds its prompt + answer and the prefill
  instance of its P leg holds its prompt (`note_served`). These optimistic entries bridge the time until
  the next poll, and are only made on instances whose last report shows a working cache (a node with the
  cache switched off reports an empty `sessions` map and holds no blocks).

Two figures per (instance, session): `held` (the report's `sessions`: leading tokens whose attention blocks
the node holds, what an import reuses: where to send the turn) and `resumable` (the report's `resumable`:
leading tokens a local prefill can resume from, held and ending in a KDA snapshot; what decides whether the
decode node may compute the rest itself, i.e. skip the P leg). Resumable comes from polls, and from a turn's
end only on instances that report `tails: true` (a finished turn stays resumable at its exact end: prompt +
answer but its last sampled token); a node that reports no `resumable` map has it equal to `sessions`.
A poll replaces an instance's entries, except held entries noted after the poll was sent (newer than what
the node could report).

The report also carries the node's `engine_id`: the router names a decode instance's as the reader of the hand-offs
it asks for (router/kvparams.py `prefill_body`), so only that instance can redeem them. The answer is signed
(`/v1/cache` is a control route, kv_transfer/cluster_auth.py); an instance that stops being healthy loses its id
until it answers again (a restarted node has a new one). A leg for an instance whose id is not known is never sent
unbound: router/readers.py reads it on demand, or the instance prefills the request itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from itertools import repeat

import httpx
import orjson

from kv_transfer.signing import ENGINE_ID_PATTERN

log = logging.getLogger("router")
MAX_SESSIONS = 1024
MAX_KEY_CHARS = 64
MAX_REPORT_BYTES = 1 << 20
HEX = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True)
class CacheReport:
    """One node's `/v1/cache` answer (counters since the node started)."""

    block_tokens: int = 0
    fingerprint: str = ""
    sessions: dict[str, int] = field(default_factory=dict, compare=False)
    resumable: dict[str, int] = field(default_factory=dict, compare=False)
    blocks_cached: int = 0
    rows_free: int = 0
    hits_tokens: int = 0
    queried_tokens: int = 0
    evicted_blocks: int = 0
    tails: bool = False
    """The node keeps each finished turn resumable at its exact end (docs/SESSIONS.md)."""
    engine_id: str | None = None
    """The node's engine id (the reader a hand-off for this decode instance is bound to); None when it reported
    none that has an engine id's shape."""

    @property
    def is_caching(self) -> bool:
        """The node's cache is on (it holds blocks or a session, or served a hit)."""
        return self.blocks_cached > 0 or self.hits_tokens > 0 or bool(self.sessions)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def is_session_key(key: object) -> bool:
    return isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS and HEX.issuperset(key)


def _sessions(raw: dict) -> dict[str, int]:
    sessions: dict[str, int] = {}
    for key, tokens in raw.items():
        if len(sessions) >= MAX_SESSIONS:
            break
        if is_session_key(key) and _count(tokens):
            sessions[key.lower()] = tokens
    return sessions


def parse_report(body: object) -> CacheReport | None:
    """A `/v1/cache` JSON answer, validated and bounded; None when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("sessions"), dict):
        return None
    sessions = _sessions(body["sessions"])
    resumable = _sessions(body["resumable"]) if isinstance(body.get("resumable"), dict) else dict(sessions)
    fingerprint, engine_id = body.get("fingerprint"), body.get("engine_id")
    if not isinstance(engine_id, str) or not ENGINE_ID_PATTERN.fullmatch(engine_id):
        engine_id = None
    return CacheReport(engine_id=engine_id, block_tokens=_count(body.get("block_tokens")),
                       fingerprint=fingerprint[:256] if isinstance(fingerprint, str) else "",
                       sessions=sessions, resumable=resumable, blocks_cached=_count(body.get("blocks_cached")),
                       rows_free=_count(body.get("rows_free")), hits_tokens=_count(body.get("hits_tokens")),
                       queried_tokens=_count(body.get("queried_tokens")),
                       evicted_blocks=_count(body.get("evicted_blocks")), tails=body.get("tails") is True)


@dataclass
class _Instance:
    report: CacheReport
    held: dict[str, tuple[int, float]]
    """session -> (tokens, when it was set)."""
    resumable: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Notes of turn ends on a node with tails: session -> (tokens, when it was set)."""
    newest_at: float = float("-inf")
    """No entry of `held` or `resumable` was set later than this."""


class CacheView:
    """Per instance: its last report and what it holds per session (polls plus optimistic notes)."""

    def __init__(self) -> None:
        self._instances: dict[str, _Instance] = {}

    def apply_report(self, instance: str, report: CacheReport, sent_at: float) -> None:
        """A poll sent at `sent_at` answered `report`: it replaces the entries older than the poll (the old entries
        are looked through only when a note is newer than the poll: each poll of every instance passes here)."""
        current = self._instances.get(instance)
        sessions = report.sessions
        held = dict(zip(sessions, zip(sessions.values(), repeat(sent_at))))
        notes: dict[str, tuple[int, float]] = {}
        newest = sent_at
        if current is not None and current.newest_at > sent_at:
            newest = current.newest_at
            for session, (tokens, at) in current.held.items():
                if at > sent_at and len(held) < MAX_SESSIONS:
                    held[session] = (tokens, at)
            notes = {s: n for s, n in current.resumable.items() if n[1] > sent_at}
        self._instances[instance] = _Instance(report, held, notes, newest)

    def forget(self, instance: str) -> None:
        self._instances.pop(instance, None)

    def forget_engine_id(self, instance: str) -> None:
        """The instance is not healthy: its engine id may change before it answers a poll again."""
        current = self._instances.get(instance)
        if current is not None and current.report.engine_id is not None:
            current.report = replace(current.report, engine_id=None)

    def engine_id(self, instance: str) -> str | None:
        """The engine id `instance` last reported while healthy (None: unknown, or not one of our nodes)."""
        current = self._instances.get(instance)
        return current.report.engine_id if current is not None else None

    def note_served(self, instance: str, session: str, tokens: int, now: float, resumable: int = 0) -> None:
        """`instance` just finished a turn of `session` and keeps `tokens` of it (when its cache is on); on a node
        with tails, it can also resume a local prefill at `resumable` (the turn's exact end)."""
        current = self._instances.get(instance)
        if current is None or not current.report.is_caching or tokens <= 0:
            return
        for table, value in ((current.held, tokens), (current.resumable, resumable)):
            if value <= 0 or (table is current.resumable and not current.report.tails):
                continue
            if session not in table and len(table) >= MAX_SESSIONS:
                oldest = min(table, key=lambda s: table[s][1])
                del table[oldest]
            table[session] = (value, now)
            current.newest_at = max(current.newest_at, now)

    def resumable(self, session: str | None) -> dict[str, int]:
        """Instance name -> leading tokens of `session` it reported it can resume a local prefill from."""
        if not session:
            return {}
        found = {}
        for name, inst in self._instances.items():
            tokens = inst.report.resumable.get(session, 0)
            note = inst.resumable.get(session)
            if note is not None:
                tokens = max(tokens, note[0])
            if tokens > 0:
                found[name] = tokens
        return found

    def held(self, session: str | None) -> dict[str, int]:
        """Instance name -> tokens of `session` it holds (instances holding nothing left out)."""
        if not session:
            return {}
        found = {}
        for name, inst in self._instances.items():
            entry = inst.held.get(session)
            if entry is not None and entry[0] > 0:
                found[name] = entry[0]
        return found

    def report(self, instance: str) -> CacheReport | None:
        current = self._instances.get(instance)
        return current.report if current else None

    def reports(self) -> dict[str, CacheReport]:
        return {name: inst.report for name, inst in self._instances.items()}


NO_ENDPOINT_SKIP_ROUNDS = 300
"""Rounds an instance that answered 404 is not polled (5 minutes at the default interval)."""


class NoCacheEndpoint(Exception):
    """The node answered 404: it has no `/v1/cache` (vLLM)."""


async def read_report(client: httpx.AsyncClient, url: str, timeout_s: float) -> CacheReport | None:
    """One `GET {url}/v1/cache`; None when the node has no cache endpoint or answers garbage."""
    async with client.stream("GET", f"{url}/v1/cache", timeout=timeout_s) as resp:
        if resp.status_code == 404:
            raise NoCacheEndpoint(url)
        if resp.status_code != 200:
            return None
        chunks, size = [], 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > MAX_REPORT_BYTES:
                return None
            chunks.append(chunk)
    try:
        return parse_report(orjson.loads(b"".join(chunks)))
    except orjson.JSONDecodeError:
        return None


class CachePoller:
    """Polls `/v1/cache` of every healthy instance into a `CacheView`, forever (cancel to stop)."""

    def __init__(self, registry, view: CacheView, client: httpx.AsyncClient, interval_s: float,
                 timeout_s: float) -> None:
        self.registry, self.view, self.client = registry, view, client
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.without_endpoint: dict[str, int] = {}
        """Instance -> polling rounds to skip: it answered 404 (asked again after NO_ENDPOINT_SKIP_ROUNDS, or
        at once when it comes back from unhealthy: a restart may have changed what it serves)."""

    def _should_poll(self, state) -> bool:
        name = state.spec.name
        if not state.is_healthy:
            self.without_endpoint.pop(name, None)
            self.view.forget_engine_id(name)
            return False
        rounds = self.without_endpoint.get(name)
        if rounds is None:
            return True
        if rounds <= 1:
            del self.without_endpoint[name]
            return True
        self.without_endpoint[name] = rounds - 1
        return False

    async def poll_one(self, state) -> None:
        name = state.spec.name
        sent_at = time.monotonic()
        try:
            report = await read_report(self.client, state.spec.url, self.timeout_s)
        except NoCacheEndpoint:
            self.without_endpoint[name] = NO_ENDPOINT_SKIP_ROUNDS
            self.view.forget(name)
            return
        except (httpx.HTTPError, OSError, ValueError) as exc:
            log.debug("cache poll of %s failed: %s", name, exc)
            return
        if report is None:
            self.view.forget(name)
        else:
            self.view.apply_report(name, report, sent_at)

    async def poll_all(self) -> None:
        states = self.registry.states()
        known = {s.spec.name for s in states}
        for name in list(self.view.reports()):
            if name not in known:
                self.view.forget(name)
        await asyncio.gather(*(self.poll_one(s) for s in states if self._should_poll(s)))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_all()
            except Exception:  # noqa: BLE001 - one bad round must not end the loop
                log.exception("cache poll round failed")
            await asyncio.sleep(self.interval_s)
