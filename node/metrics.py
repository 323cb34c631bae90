"""Prometheus metrics of one node (prefill or decode), in a registry owned by the app.

Names are the contract of docs/METRICS.md: vLLM's own names wherever vLLM has the metric, so one
dashboard serves both engines, and `pdcluster_node_*` for what only the reference engine has.
prometheus_client appends `_total` to counters, so `Counter("vllm:prompt_tokens")` is exported as
`vllm:prompt_tokens_total`. No module-global registry: each `NodeMetrics` has its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
XFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(4 ** i) * 1024 for i in range(13))  # 1 KiB .. 16 GiB
DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class CacheInfo:
    """Static cache facts exported as `vllm:cache_config_info` labels."""

    block_size: int
    cache_dtype: str
    num_gpu_blocks: int
    layout_fingerprint: str
    tp_size: int
    dcp_size: int
    engine: str = "reference"
    kernels: str = "reference"
    """The kernel set the ranks' engines run (node setting `kernels`, resolved): "reference" or "fast"."""


class NodeMetrics:
    """Every metric a node exports; `render()` is the /metrics body."""

    def __init__(self, model_name: str, role: str) -> None:
        self.model_name = model_name
        self.role = role
        self.registry = CollectorRegistry()
        reg, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Node-side time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between output tokens.", m,
                             buckets=ITL_BUCKETS, registry=reg)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "(E2E - TTFT) / (n - 1).", m,
                              buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency inside the node.", m,
                             buckets=E2E_BUCKETS, registry=reg)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", m, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", m, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Used rows / all rows (0..1).", m, registry=reg)
        self.cache_info = Gauge("vllm:cache_config_info", "Static cache configuration.",
                                ["block_size", "cache_dtype", "num_gpu_blocks", "layout_fingerprint", "tp_size",
                                 "dcp_size", "engine", "kernels"], registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests.", ["model_name", "finished_reason"],
                                       registry=reg)
        self.num_preemptions = Counter("vllm:num_preemptions", "Running requests preempted for rows (recomputed "
                                       "when re-admitted: engine/scheduler.py `preempt`).", m, registry=reg)
        self.num_preemptions.labels(model_name)
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds", "One READ, post to completion.",
                                   buckets=XFER_BUCKETS, registry=reg)
        self.post_time = Histogram("vllm:nixl_post_time_seconds", "Posting time of one READ.",
                                   buckets=XFER_BUCKETS, registry=reg)
        self.xfer_bytes = Histogram("vllm:nixl_bytes_transferred", "Bytes per READ.", buckets=BYTES_BUCKETS,
                                    registry=reg)
        self.xfer_descs = Histogram("vllm:nixl_num_descriptors", "Descriptors per READ after merging.",
                                    buckets=DESC_BUCKETS, registry=reg)
        self.failed_transfers = Counter("vllm:nixl_num_failed_transfers", "Failed READs.", registry=reg)
        self.expired_reqs = Counter("vllm:nixl_num_kv_expired_reqs", "Prefill-side leases that expired.",
                                    registry=reg)
        self._node_metrics(reg)

    def _node_metrics(self, reg: CollectorRegistry) -> None:
        self.rows_used = Gauge("pdcluster_node_kv_rows_used", "Packed rows in use.", ["role"], registry=reg)
        self.rows_total = Gauge("pdcluster_node_kv_rows_total", "Packed rows in the pool.", ["role"], registry=reg)
        self.prefill_seconds = Histogram("pdcluster_node_prefill_seconds", "One prefill step.", ["mode"],
                                         buckets=TTFT_BUCKETS, registry=reg)
        self.rows_exported = Counter("pdcluster_node_rows_exported", "Rows handed to decode.", registry=reg)
        self.leases_outstanding = Gauge("pdcluster_node_leases_outstanding", "Prefill rows held for a reader.",
                                        registry=reg)
        self.lease_outcomes = Counter("pdcluster_node_lease_outcomes", "How leases ended.", ["outcome"],
                                      registry=reg)
        self.handoffs_issued = Counter("pdcluster_node_handoffs_issued", "Hand-offs granted, by reader: `bound` "
                                       "names the one decode engine that may redeem it, `any` names none.",
                                       ["reader"], registry=reg)
        self.alltoall_bytes = Counter("pdcluster_node_alltoall_bytes", "Token-sharded prefill exchange bytes.",
                                      registry=reg)
        self.dcp_merge_bytes = Counter("pdcluster_node_dcp_merge_bytes", "DCP top-k merge bytes.", ["method"],
                                       registry=reg)
        self.dcp_merge_fallbacks = Counter("pdcluster_node_dcp_merge_fallbacks", "Compact-merge resends.",
                                           registry=reg)
        self.streams_moved = Counter("pdcluster_node_streams_moved", "Streams a draining decode node handed off: "
                                     "leased with their KV, recomputed elsewhere, or handed back before anything was "
                                     "computed here.", ["outcome"], registry=reg)
        self.kv_moved_bytes = Counter("pdcluster_kv_moved_bytes", "KV bytes this decode node READ from another "
                                      "decode instance (a stream moved decode-to-decode).", registry=reg)
        self.kv_moved_reads = Counter("pdcluster_kv_moved_requests", "Streams this decode node took over with "
                                      "their KV READ from another decode instance.", registry=reg)
        for outcome in ("leased", "recomputed", "handed_back"):
            self.streams_moved.labels(outcome=outcome)
        self.ucx_tcp_fallback = Gauge("pdcluster_node_ucx_tcp_fallback", "1 if UCX fell back to TCP.",
                                      registry=reg)
        self._prefix_cache_metrics(reg)

    def _prefix_cache_metrics(self, reg: CollectorRegistry) -> None:
        """docs/SESSIONS.md: the prefix cache's hits, evictions and what imports read vs reused."""
        role = ["role"]
        self.prefix_queried = Counter("pdcluster_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                                      "prefix cache.", role, registry=reg)
        self.prefix_hits = Counter("pdcluster_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                                   "cache (not computed, not read).", role, registry=reg)
        self.prefix_evicted = Counter("pdcluster_prefix_cache_evicted_blocks", "Cache blocks evicted for rows.",
                                      role, registry=reg)
        self.prefix_blocks = Gauge("pdcluster_prefix_cache_blocks", "Blocks held by the prefix cache.", role,
                                   registry=reg)
        self.transfer_blocks = Counter("pdcluster_kv_transfer_blocks", "Prompt blocks of imports: read over the "
                                       "transport, or reused from this node's cache.", ["role", "kind"],
                                       registry=reg)
        for child in (self.prefix_queried, self.prefix_hits, self.prefix_evicted, self.prefix_blocks):
            child.labels(role=self.role)
        for kind in ("read", "reused"):
            self.transfer_blocks.labels(role=self.role, kind=kind)
        self.requests = Counter("pdcluster_node_requests", "Requests by admission outcome.", ["outcome"],
                                registry=reg)
        for outcome in ("admitted", "shed"):
            self.requests.labels(outcome=outcome)
        self.requests_in_flight = Gauge("pdcluster_node_requests_in_flight",
                                        "Requests admitted here and not finished (running, queued, importing).",
                                        registry=reg)
        self.import_queue_depth = Gauge("pdcluster_node_import_queue_depth",
                                        "Imports waiting for free rows (decode nodes).", registry=reg)

    # ------------------------------------------------------------------ updates

    def set_cache_info(self, info: CacheInfo) -> None:
        self.cache_info.clear()
        self.cache_info.labels(
            block_size=str(info.block_size), cache_dtype=info.cache_dtype, num_gpu_blocks=str(info.num_gpu_blocks),
            layout_fingerprint=info.layout_fingerprint, tp_size=str(info.tp_size), dcp_size=str(info.dcp_size),
            engine=info.engine, kernels=info.kernels,
        ).set(1)
        self.rows_total.labels(role=self.role).set(info.num_gpu_blocks)
        if info.dcp_size > 1:  # the merge a DCP pool runs exists (at 0) before its first decode step
            self.dcp_merge_bytes.labels(method="compact")

    def set_load(self, num_running: int, num_waiting: int, rows_used: int, rows_total: int) -> None:
        self.running.labels(self.model_name).set(num_running)
        self.waiting.labels(self.model_name).set(num_waiting)
        self.rows_used.labels(role=self.role).set(rows_used)
        self.rows_total.labels(role=self.role).set(rows_total)
        self.kv_usage.labels(self.model_name).set(rows_used / rows_total if rows_total else 0.0)

    def observe_request(self, record: "RequestTiming") -> None:
        """Record one finished request's latencies and token counts."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(record.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(record.num_output_tokens)
        self.request_success.labels(name, record.finish_reason).inc()
        if record.ttft is not None:
            self.ttft.labels(name).observe(record.ttft)
        for gap in record.gaps:
            self.itl.labels(name).observe(gap)
        self.e2e.labels(name).observe(record.e2e)
        if record.ttft is not None and record.num_output_tokens > 1:
            self.tpot.labels(name).observe((record.e2e - record.ttft) / (record.num_output_tokens - 1))

    def add_counter(self, name: str, delta: float) -> None:
        """Add a rank-reported cumulative counter's increase (names as the backends report them)."""
        if name == "alltoall_bytes":
            self.alltoall_bytes.inc(delta)
        elif name.startswith("dcp_merge_bytes_"):
            self.dcp_merge_bytes.labels(method=name.removeprefix("dcp_merge_bytes_")).inc(delta)
        elif name == "dcp_merge_fallbacks":
            self.dcp_merge_fallbacks.inc(delta)
        elif name in _PREFIX_COUNTERS:
            getattr(self, _PREFIX_COUNTERS[name]).labels(role=self.role).inc(delta)
        elif name == "num_preemptions":
            self.num_preemptions.labels(self.model_name).inc(delta)
        elif name.startswith("kv_transfer_blocks_"):
            self.transfer_blocks.labels(role=self.role, kind=name.removeprefix("kv_transfer_blocks_")).inc(delta)

    def observe_timing(self, name: str, label: str, seconds: float) -> None:
        """A rank-reported duration (names as the backends report them)."""
        if name == "prefill":
            self.prefill_seconds.labels(mode=label).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_PREFIX_COUNTERS = {"prefix_cache_queried_tokens": "prefix_queried", "prefix_cache_hit_tokens": "prefix_hits",
                    "prefix_cache_evicted_blocks": "prefix_evicted"}


@dataclass
class RequestTiming:
    """What a finished request contributes to the latency histograms."""

    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str
    e2e: float
    ttft: float | None = None
    gaps: tuple[float, ...] = ()
