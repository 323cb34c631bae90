"""The reader of a hand-off: the engine id of the decode instance that alone may redeem it.

Our decode nodes (engine "reference") report their engine id in their signed `GET /v1/cache`
(router/cache_view.py). The router binds every hand-off meant for one of them to that id, and never asks for an
unbound one:
- a P leg names the chosen decode instance as `decode_engine_id` (router/kvparams.py `prefill_body`);
- a stream a draining node moved out with its KV (transfer_mode "move", leased before anyone knew its next
  instance) is bound at its source before the new instance is sent the params (`bind_move`: the side channel's
  signed `POST /kv/leases/{id}/bind`; the source refuses every claim until then, and every other reader after).
`reader_for` answers the id the last poll read; when there is none yet (the node just started, or came back
from unhealthy and was not polled since) it reads `/v1/cache` once on demand (one read in flight per instance,
shared by the requests that wait for it; its report is applied as a poll's). An instance whose id still cannot be
learned raises `UnknownReader`: the request is served without a P leg (the decode node prefills it itself), and a
moved stream is recomputed there. vLLM instances have no `/v1/cache` and check no binding: their hand-offs stay
unbound (None), as in vLLM's own protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from router.cache_view import CacheView, NoCacheEndpoint, read_report
from router.registry import Registry

log = logging.getLogger("router")

BINDING_ENGINES = frozenset({"reference"})
"""Engines whose decode nodes report an engine id and verify the reader a hand-off names."""


class UnknownReader(Exception):
    """The decode instance binds its hand-offs but its engine id is not known (the message says why)."""


class Readers:
    """Engine ids of the decode instances, from the cache view or read on demand (see the module docstring)."""

    def __init__(self, registry: Registry, view: CacheView, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.registry, self.view, self.client, self.timeout_s = registry, view, client, timeout_s
        self._reads: dict[str, asyncio.Future[str | None]] = {}
        """Instance -> its on-demand `/v1/cache` read in flight (shared by every request that waits for it)."""

    def binds(self, decode: str) -> bool:
        """`decode` is one of our nodes: a hand-off for it must name its engine id."""
        state = self.registry.get(decode)
        engine = (state.geometry or self.registry.view(state).geometry).engine if state is not None else None
        return engine in BINDING_ENGINES

    async def reader_for(self, decode: str) -> str | None:
        """The engine id a hand-off for `decode` is bound to: the one it reported; None for an instance that reports
        none and binds nothing (vLLM); UnknownReader when `decode` binds its hand-offs and its id cannot be learned
        now."""
        known = self.view.engine_id(decode)
        if known is not None or not self.binds(decode):
            return known
        read = self._reads.get(decode)
        if read is None:
            read = asyncio.ensure_future(self._read(decode))
            self._reads[decode] = read
            read.add_done_callback(lambda _: self._reads.pop(decode, None))
        engine_id = await asyncio.shield(read)
        if engine_id is None:
            raise UnknownReader(f"decode instance {decode} has not reported its engine id")
        return engine_id

    async def _read(self, decode: str) -> str | None:
        state = self.registry.get(decode)
        if state is None or not state.is_healthy:
            return None
        sent_at = time.monotonic()
        try:
            report = await read_report(self.client, state.spec.url, self.timeout_s)
        except (NoCacheEndpoint, httpx.HTTPError, OSError, ValueError) as exc:
            log.info("engine id of %s could not be read: %r", decode, exc)
            return None
        if report is None or report.engine_id is None or not state.is_healthy:
            return None
        self.view.apply_report(decode, report, sent_at)
        return report.engine_id

    async def bind_move(self, source: str, lease_id: object, decode: str) -> str | None:
        """Bind the lease of a stream `source` moved out with its KV to `decode`, before `decode` is sent the params
        (the source's side channel, signed by the router's client); why it could not (None: bound)."""
        try:
            reader = await self.reader_for(decode)
        except UnknownReader as exc:
            return str(exc)
        state = self.registry.get(source)
        if reader is None or state is None or not isinstance(lease_id, str):
            return f"no reader to bind the lease to ({decode}), or no lease at {source}"
        try:
            resp = await self.client.post(f"{state.spec.url}/kv/leases/{lease_id}/bind", json={"reader": reader},
                                          timeout=self.timeout_s)
        except (httpx.HTTPError, OSError) as exc:
            return f"binding the moved lease at {source} failed: {type(exc).__name__}"
        if resp.status_code != 200:
            return f"{source} refused to bind the moved lease to {decode} ({resp.status_code})"
        return None
