"""The router's one pydantic-settings `Settings` (env prefix `ROUTER_`), which Helm values map onto.

Every tunable of the router lives here: listen address, the config file, timeouts per leg and the
fallback policy, health thresholds, breaker limits, placement knobs and the admin token. Values come
from the environment (`ROUTER_PREFILL_TIMEOUT_S=5`), from a `router:` section of the YAML config, or
from keyword arguments in tests; nothing else in the package reads the environment.
"""

from __future__ import annotations

from typing import Literal

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    config_file: str | None = None
    """YAML file with pools, static instances and discovery (see router/config.py)."""
    prefill_urls: list[str] = Field(default_factory=list)
    """Quick start: prefill instances (one pool, facts read from the nodes)."""
    decode_urls: list[str] = Field(default_factory=list)
    engine: Literal["vllm", "reference"] = "vllm"
    """Engine of quick-start instances when the node does not say."""

    admin_token: str | None = None
    """Bearer token for /v1/pools and /admin/*; admin endpoints refuse every call when unset."""
    admin_token_file: str | None = None
    """A file holding the admin token (a Secret mounted as a file: the chart's way); fills `admin_token`."""
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_limit: int = 1_000_000

    prefill_timeout_s: float = 60.0
    """Whole P leg (request to JSON answer)."""
    first_token_timeout_s: float = 60.0
    """D leg from dispatch to the first output byte (covers the KV fetch and the first decode step)."""
    decode_timeout_s: float = 600.0
    """Whole D leg of a non-streaming request."""
    stream_idle_timeout_s: float = 60.0
    """Largest gap between two chunks of the D stream."""
    connect_timeout_s: float = 5.0
    prefill_fallback: Literal["decode_only", "fail"] = "decode_only"
    """When every P attempt failed or timed out: let D prefill locally, or answer 502/504."""
    prefill_max_attempts: int = 2
    """P leg tries, each on another compatible prefill instance."""
    migration_limit: int = Field(default=3, ge=0)
    """Times a request may move to another decode instance after its decode instance failed, continuing the
    same answer (router/migration.py; our engine's pools only); 0: never, the failure ends the request."""
    migration_timeout_s: float = Field(default=120.0, gt=0)
    """A request stops moving this long after its first decode failure (the client then gets one error)."""

    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    facts_interval_s: float = 10.0
    """How often /v1/models and /metrics facts are refreshed (load figures ride on every health round)."""

    breaker_failure_threshold: int = 3
    breaker_recovery_s: float = 15.0

    max_inflight_per_pool: int = Field(default=1024, ge=0)
    """Admission cap: requests in flight per decode pool in this router replica (0: no cap). Beyond it the
    router answers 429 with Retry-After at once. With several worker processes each worker admits its share,
    ceil(cap / workers) (router/admission.py)."""
    pool_max_inflight: dict[str, int] = Field(default_factory=dict)
    """Per-pool caps that override `max_inflight_per_pool` (pool name -> cap, 0: no cap)."""
    shed_retry_after_s: int = Field(default=1, ge=1)
    """Retry-After (seconds) on the router's own 429s."""

    keep_alive_s: float = Field(default=75.0, gt=0)
    """Idle keep-alive client connections are closed after this long."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """Request line plus headers of one request; beyond it 431 and the connection is closed."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """A request whose headers or body do not arrive completely within this long gets 408 (slow senders)."""
    head_read_timeout_s: float = Field(default=10.0, gt=0)
    """A request whose line and headers do not arrive within this long of its first byte gets 408, and a new
    connection that sends no request within it is closed (slowloris)."""
    max_pipelined_requests: int = Field(default=16, ge=1)
    """Received requests that may wait for their turn on one connection; at the bound the router reads nothing
    more from it until one is answered, and a request past it in the same read gets 429 and ends the connection."""
    write_timeout_s: float = Field(default=60.0, gt=0)
    """A client that reads nothing of its reply (a stalled SSE reader) for this long is disconnected (the
    request ends `cancelled`, both legs are aborted)."""

    max_connections: int = Field(default=20_000, ge=1)
    """Open client connections per worker process; a connection beyond it gets 503 and is closed."""
    upstream_max_connections: int = Field(default=0, ge=0)
    """Connections per worker process to one node (P and D legs; 0: no bound). A leg beyond it waits, first
    come first served, for one of them to come back, within the leg's own timeout (router/upstream.py)."""

    peer_urls: list[str] = Field(default_factory=list)
    """Other router replicas (base URLs) that admin drains are broadcast to (router/peers.py)."""
    peer_dns: str | None = None
    """`host:port` of a headless Service whose addresses are every router replica (the chart's `-peers`
    Service): resolved at each broadcast; this replica's own address is skipped."""

    disagg_min_uncached_tokens: int = 32
    """Conditional disaggregation: skip the P leg when fewer uncached prompt tokens are expected."""
    session_ttl_s: float = 1800.0
    max_sessions: int = 100_000
    session_growth_tokens: int = 2048
    """Expected growth of a session's context beyond this request (projected context headroom)."""
    default_max_tokens: int = 256
    """Output length assumed for placement when the request names none."""
    chars_per_token: float = 4.0
    """Tokenize-free prompt length estimate (`prompt_estimate` chars)."""
    # --- sessions, API keys and cache-aware routing (router/identity.py, router/cache_view.py) ---
    prompt_estimate: Literal["auto", "bytes", "chars"] = "auto"
    """How the router counts a prompt's tokens without tokenizing: `bytes` renders the reference engine's
    byte-level chat template (exact for its ByteTokenizer), `chars` divides characters by `chars_per_token`;
    `auto`: bytes when every decode instance runs the reference engine, else chars."""
    api_keys: str | None = None
    """Comma-separated client API keys (e.g. env ROUTER_API_KEYS from a Secret); unset with no file: no auth."""
    api_keys_file: str | None = None
    """File of client API keys, one per line (`#` comments), e.g. a Secret mounted as a file."""
    cluster_secret_file: str | None = None
    """File holding the cluster secret (the nodes' `cluster_secret_file`): every request the router sends a node
    from its shared client (aborts, `/v1/cache` polls, health) is signed with it (kv_transfer/cluster_auth.py); the
    nodes' control routes refuse unsigned ones. Unset: an insecure cluster (nodes with `insecure_handoffs`)."""
    cache_poll_interval_s: float = Field(default=1.0, gt=0)
    """How often every healthy node's `GET /v1/cache` is read (what each holds per session)."""
    cache_poll_timeout_s: float = Field(default=2.0, gt=0)
    # --- end sessions ---

    workers: int = 1
    """Worker processes serving the port (`pdcluster router --workers N`; default there: the cores available).
    Shared between them: drains, metrics and health news (router/shared.py); per worker: breakers, warm
    pairs and session tables (sessions placed by a hash every worker agrees on)."""
    worker_id: int = 0
    """Set by the worker supervisor; 0 for a single worker."""
    state_dir: str | None = None
    """Directory the workers share (drain markers, metric snapshots); set by the supervisor when workers > 1."""
    shared_sync_interval_s: float = 1.0
    """How often a worker re-reads the drain markers and publishes its metric snapshot (siblings are also
    told at once; these are the fallback)."""

    kube_namespace: str | None = None
    kube_label_selector: str = "app.kubernetes.io/part-of=pdcluster"
    kube_watch_timeout_s: int = 60

    @model_validator(mode="after")
    def _admin_token_from_file(self) -> "Settings":
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise ValueError("set admin_token or admin_token_file, not both")
            token = Path(self.admin_token_file).read_text().strip()
            if not token:
                raise ValueError(f"admin_token_file {self.admin_token_file} is empty")
            self.admin_token = token
        return self
