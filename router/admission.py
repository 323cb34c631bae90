"""Admission control: a cap on the requests in flight per decode pool, and what counts as shedding.

A request is admitted once placement chose its pool; it holds its slot until `service.finish` ran for it
(any outcome). Beyond the cap the router answers 429 with `Retry-After` at once, counted
`pdcluster_requests_total{outcome="shed"}`, and never touches a node (nor a breaker).

Worker processes: each worker of a replica admits its share of the cap, `ceil(cap / workers)` (the kernel
spreads connections over the workers with SO_REUSEPORT, so the shares fill about evenly; a replica may
admit up to `workers - 1` more than the cap, never fewer than the cap when load is spread). Replicas:
the cap is per replica (`router.replicas` x cap for the whole Service).

A node's own shedding (429, or 503 with `Retry-After`) is not an upstream failure either: `is_node_shed`
tells the legs to leave the breakers closed and hand the answer, Retry-After included, to the client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from router.metrics import RouterMetrics
from router.settings import Settings
from serving.errors import DRAINING_HEADER


class PoolFull(Exception):
    """The chosen pool is at its cap (the router sheds the request)."""

    def __init__(self, pool: str, limit: int) -> None:
        super().__init__(f"pool {pool} has {limit} requests in flight (its limit in this router process)")
        self.pool = pool
        self.limit = limit


def worker_share(cap: int, workers: int) -> int:
    """This worker's part of a replica-wide cap (0 stays 'no cap')."""
    return 0 if cap <= 0 else math.ceil(cap / max(1, workers))


class Admission:
    """In-flight counts per pool in one worker process; `enter`/`leave` are a dict read and an add (the
    gauges are set from the counts when metrics are rendered: `publish`)."""

    def __init__(self, settings: Settings, metrics: RouterMetrics) -> None:
        self.default_cap = worker_share(settings.max_inflight_per_pool, settings.workers)
        self.caps = {pool: worker_share(cap, settings.workers) for pool, cap in settings.pool_max_inflight.items()}
        self.retry_after_s = settings.shed_retry_after_s
        self.inflight: dict[str, int] = {}
        self.metrics = metrics

    def limit(self, pool: str) -> int:
        return self.caps.get(pool, self.default_cap)

    def enter(self, pool: str) -> None:
        """Take a slot in `pool` or raise PoolFull."""
        count = self.inflight.get(pool, 0)
        limit = self.caps.get(pool, self.default_cap)
        if limit and count >= limit:
            raise PoolFull(pool, limit)
        self.inflight[pool] = count + 1

    def leave(self, pool: str) -> None:
        self.inflight[pool] -= 1

    def move(self, old: str, new: str) -> None:
        """An admitted request moved to another pool (router/moves.py): its slot goes with it, past the cap
        (it was admitted once; shedding it mid-answer would lose what the client already has)."""
        self.inflight[old] -= 1
        self.inflight[new] = self.inflight.get(new, 0) + 1

    def publish(self, pools: list[str] = ()) -> None:
        """Set the in-flight and limit gauges of `pools` and of every pool seen so far."""
        for pool in {*pools, *self.inflight}:
            self.metrics.pool_inflight.labels(pool).set(self.inflight.get(pool, 0))
            self.metrics.pool_inflight_limit.labels(pool).set(self.limit(pool))


def is_node_draining(status: int, headers: Mapping[str, str]) -> bool:
    """A node's 503 refusing a request because it is shutting down (serving/errors.py `DRAINING_HEADER`): it
    computed nothing, and the request belongs on another instance, not back at the client."""
    return status == 503 and headers.get(DRAINING_HEADER) == "1"


def is_node_shed(status: int, headers: Mapping[str, str]) -> bool:
    """A node's 'busy, come back later': 429, or 503 with Retry-After (a 503 without it is a failure)."""
    return status == 429 or (status == 503 and "retry-after" in headers)
