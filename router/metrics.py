"""The router's Prometheus series (`pdcluster_*`, names per docs/METRICS.md), in a registry per app.

Client-seen latency histograms carry (pool, model); TTFT buckets include 2.0 s. The router's own share
of an ok request (`pdcluster_router_overhead_seconds`: e2e minus the time inside its P and D legs) has
sub-millisecond buckets. `refresh_gauges`
recomputes instance, pair and session gauges from the registry at scrape time. Counters and histograms are
router/local_metrics.py's lock-free ones (the request path updates a dozen per request); gauges are
prometheus_client's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.local_metrics import LocalCounter as Counter
from router.local_metrics import LocalHistogram as Histogram
from router.migration import REASONS as MIGRATION_REASONS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0)
LEG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "cancelled", "shed")
"""`shed`: answered 429/503 with Retry-After, by the router's admission cap or a node's own."""
TIMED_LEGS = ("prefill", "decode", "first_decode")
OBSERVED_LEGS = ("prefill", "kv_transfer", "first_decode")
"""The legs `pdcluster_leg_duration_seconds` observes (router/service.py `finish`)."""


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self._children: dict[tuple, object] = {}
        pm = ["pool", "model"]
        self.ttft = Histogram("pdcluster_time_to_first_token_seconds", "Client-seen time to first token.", pm,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("pdcluster_time_per_output_token_seconds", "Client-seen time per output token.",
                              pm, buckets=ITL_BUCKETS, registry=reg)
        self.itl = Histogram("pdcluster_inter_token_latency_seconds", "Client-seen gap between chunks.", pm,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("pdcluster_e2e_request_latency_seconds", "Client-seen request latency.", pm,
                             buckets=E2E_BUCKETS, registry=reg)
        self.leg = Histogram("pdcluster_leg_duration_seconds", "Per-leg duration.", ["leg", "pool"],
                             buckets=LEG_BUCKETS, registry=reg)
        self.overhead = Histogram("pdcluster_router_overhead_seconds",
                                  "Router time of a request outside its upstream legs (e2e minus P and D legs).",
                                  ["pool"], buckets=OVERHEAD_BUCKETS, registry=reg)
        self.requests = Counter("pdcluster_requests", "Requests by outcome.", ["outcome", "pool"], registry=reg)
        self.leg_timeouts = Counter("pdcluster_leg_timeouts", "Per-leg timeouts.", ["leg"], registry=reg)
        self.retries = Counter("pdcluster_retries", "Retried legs.", ["leg"], registry=reg)
        self.migrations = Counter("pdcluster_migrations", "Requests moved to another decode instance after their "
                                  "decode instance failed, by reason (router/migration.py).", ["reason"],
                                  registry=reg)
        self.resume_latency = Histogram("pdcluster_resume_latency_seconds",
                                        "Client-seen pause of a moved stream: its last token before the failure to "
                                        "its first after.", [], buckets=LEG_BUCKETS, registry=reg)
        # --- sessions and prefix cache (router/session_routing.py): from the usage each client saw ---
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "Prompt tokens of ok requests (usage).", ["pool"],
                                     registry=reg)
        self.cached_prompt_tokens = Counter(
            "pdcluster_cached_prompt_tokens",
            "Prompt tokens of ok requests a node's prefix cache supplied (the client's usage cached_tokens).",
            ["pool"], registry=reg)
        self.prefill_skipped = Counter("pdcluster_prefill_skipped",
                                       "Ok requests whose P leg was skipped because the decode instance held the "
                                       "session's prefix.", ["pool"], registry=reg)
        # --- end sessions ---
        self.active_sessions = Gauge("pdcluster_active_sessions", "Sessions with a placement.", ["pool"],
                                     registry=reg)
        self.instance_healthy = Gauge("pdcluster_instance_healthy", "1 healthy, 0 not.",
                                      ["instance", "role", "pool"], registry=reg)
        self.pair_healthy = Gauge("pdcluster_pair_healthy", "1 usable pair, 0 broken or open breaker.",
                                  ["prefill", "decode"], registry=reg)
        self.pool_inflight = Gauge("pdcluster_pool_inflight_requests",
                                   "Requests admitted and not finished, per decode pool (router/admission.py).",
                                   ["pool"], registry=reg)
        self.pool_inflight_limit = Gauge("pdcluster_pool_inflight_limit",
                                         "Admission cap on in-flight requests per decode pool (0: none).",
                                         ["pool"], registry=reg)
        self.pair_compatible = Gauge("pdcluster_pair_compatible", "1 if the pairing matrix allows the pair.",
                                     ["prefill", "decode"], registry=reg)

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, looked up once (counters and histograms only: gauges are cleared)."""
        key = (metric._name, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def prime(self, pools: list[str], models: tuple[str, ...] | list[str] = ()) -> None:
        """Create every counter and histogram child whose labels are known in advance (pools, the served model
        ids), at 0, so panels and ratios over them are never empty on a healthy cluster, and so that rate()
        counts a series' first requests: a child created by its first observation is first scraped with
        that count already in it, which rate() cannot see as an increase (a burst that ends within one scrape
        interval would leave every latency panel without data)."""
        for leg in TIMED_LEGS:
            self.leg_timeouts.labels(leg)
            self.retries.labels(leg)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        for pool in pools:
            for outcome in OUTCOMES:
                self.requests.labels(outcome, pool)
            for counter in (self.prompt_tokens, self.cached_prompt_tokens, self.prefill_skipped):
                counter.labels(pool)
            for leg in OBSERVED_LEGS:
                self.leg.labels(leg, pool)
            self.overhead.labels(pool)
            for model in models:
                for histogram in (self.ttft, self.tpot, self.itl, self.e2e):
                    histogram.labels(pool, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reset_gauges(self) -> None:
        for gauge in (self.instance_healthy, self.pair_healthy, self.pair_compatible, self.active_sessions):
            gauge.clear()
