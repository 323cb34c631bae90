"""Health checking with thresholds, and node-fact refresh.

Each round probes every instance's `GET /health` (timeout `health_timeout_s`): an instance turns
unhealthy after `unhealthy_threshold` consecutive failures and healthy again after `healthy_threshold`
consecutive successes (then `on_recovered` closes its breakers). A healthy round also scrapes `/metrics`
(load figures, cache facts) and, every `facts_interval_s` or while facts are missing, `/v1/models`. Instances that discovery reports not ready
are unhealthy without a probe. The compat matrix is recomputed when facts change.

A probe fails, per instance, on anything: a non-200 `/health`, a timeout, a refused connection, a
`/v1/models` that is not a model list or lists no model (`[]`, garbage JSON), unparsable `/metrics`, or
any other exception (logged). One bad node never stops the round, the loop or the router's start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from router.facts import parse_metrics, parse_models
from router.registry import InstanceState, Registry

log = logging.getLogger("router")


class BadFacts(Exception):
    """A node answered its fact endpoints with something the router cannot serve from."""


def apply_probe(state: InstanceState, ok: bool, unhealthy_threshold: int, healthy_threshold: int,
                error: str | None = None) -> bool:
    """Fold one probe result into `state`; True when the healthy flag flipped."""
    before = state.is_healthy
    if ok:
        state.num_consecutive_successes += 1
        state.num_consecutive_failures = 0
        state.last_error = None
        if not state.is_healthy and state.num_consecutive_successes >= healthy_threshold:
            state.is_healthy = True
    else:
        state.num_consecutive_failures += 1
        state.num_consecutive_successes = 0
        state.last_error = error
        if state.is_healthy and state.num_consecutive_failures >= unhealthy_threshold:
            state.is_healthy = False
    return before != state.is_healthy


class HealthChecker:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, *, interval_s: float, timeout_s: float,
                 unhealthy_threshold: int, healthy_threshold: int, facts_interval_s: float) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self.facts_interval_s = facts_interval_s
        self._facts_at: dict[str, float] = {}
        self.on_change = None
        """Awaited after a round that changed health or facts (router/shared.py tells sibling workers)."""
        self.on_recovered: Callable[[str], None] | None = None
        """Called with the name of each instance that turned healthy again (its breakers close: router/breaker.py
        `Breakers.recovered`)."""

    async def _refresh_facts(self, state: InstanceState) -> bool:
        """Scrape /metrics (every round) and /v1/models (when due); True if geometry facts changed."""
        url, name = state.spec.url, state.spec.name
        before = (state.cache, state.models)
        metrics = await self.client.get(f"{url}/metrics", timeout=self.timeout_s)
        if metrics.status_code == 200:
            state.cache, state.load = parse_metrics(metrics.text)
        due = time.monotonic() - self._facts_at.get(name, -1e9) >= self.facts_interval_s
        if due or not state.models.model_ids:
            models = await self.client.get(f"{url}/v1/models", timeout=self.timeout_s)
            if models.status_code != 200:
                raise BadFacts(f"/v1/models answered {models.status_code}")
            try:
                body = models.json()
            except ValueError:
                raise BadFacts("/v1/models is not JSON") from None
            if not isinstance(body, dict) or not isinstance(body.get("data"), list):
                raise BadFacts("/v1/models is not a model list")
            facts = parse_models(body)
            if not facts.model_ids:
                raise BadFacts("/v1/models lists no model")
            state.models = facts
            self._facts_at[name] = time.monotonic()
        return before != (state.cache, state.models)  # ModelFacts compare without the raw cards

    async def probe(self, state: InstanceState) -> bool:
        """One probe of one instance; True when health or facts changed."""
        if not state.spec.ready:
            return apply_probe(state, False, 1, self.healthy_threshold, "not ready (discovery)")
        try:
            resp = await self.client.get(f"{state.spec.url}/health", timeout=self.timeout_s)
            ok, error = resp.status_code == 200, f"/health answered {resp.status_code}"
            changed = await self._refresh_facts(state) if ok else False
        except (httpx.HTTPError, ValueError, BadFacts) as exc:
            ok, error, changed = False, f"{type(exc).__name__}: {exc}", False
        except Exception as exc:  # noqa: BLE001 - one node's oddity must not stop the round
            log.warning("health probe of %s failed unexpectedly: %r", state.spec.name, exc)
            ok, error, changed = False, f"{type(exc).__name__}: {exc}", False
        flipped = apply_probe(state, ok, self.unhealthy_threshold, self.healthy_threshold, None if ok else error)
        if flipped and state.is_healthy and self.on_recovered is not None:
            self.on_recovered(state.spec.name)
        return flipped or changed

    async def check_all(self, notify: bool = True) -> None:
        states = self.registry.states()
        results = await asyncio.gather(*(self.probe(s) for s in states))
        if any(results):
            self.registry.recompute_matrix()
            if notify and self.on_change is not None:
                await self.on_change()

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception as exc:  # noqa: BLE001 - the loop outlives any one bad round
                log.warning("health round failed: %r", exc)
            await asyncio.sleep(self.interval_s)
