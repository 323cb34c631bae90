"""Measure a real cluster on this machine: `pdcluster up`'s launcher plus loadgen's sweep, in one call.

`RealCluster(config, log_dir)` starts the cluster of `config` (its router on a free port) and `sweep(...)` runs
loadgen's sweep against the router exactly as `pdcluster loadgen` does, returning the Summary (also written to its
`out_dir`); `measure(...)` is one sweep on a cluster of its own, after its `Warmup` requests. Used by `pdcluster sim calibrate` and
benchmarks/sim_validation.py: the measured side of every comparison.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from loadgen.client import Target
from loadgen.lengths import parse_dist
from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload
from loadgen.schedule import Workload
from loadgen.slo import SLO
from loadgen.summary import Summary
from loadgen.sweep import SweepOptions, run_sweep


WARMUP_SEED = 3
"""The warm-up's words: a stream of their own (no measured prompt finds them cached)."""


TOKEN_GAPS = "vllm:inter_token_latency_seconds"
"""A node's histogram of the gaps between each request's consecutive tokens, stamped as its HTTP layer receives
them (node/textgen.py, node/metrics.py): one gap per token after a request's first, every one a rank round."""


PREFILL_SECONDS = "pdcluster_node_prefill_seconds"
"""A prefill node's histogram of its prefill steps (node/metrics.py): its sum over a stretch of time is how long the
node computed prefills in it."""


def histogram_totals(text: str, name: str) -> tuple[float, int]:
    """(sum, count) of the Prometheus histogram `name` in a /metrics page, over all its label sets; (0.0, 0) when
    the page has none yet."""
    from prometheus_client.parser import text_string_to_metric_families

    total, count = 0.0, 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += int(sample.value)
    return total, count


@dataclass(frozen=True)
class Warmup:
    """Untimed requests before a measurement, one at a time: `requests` prompts of `words` fresh words, `max_tokens`
    out each. What a fresh cluster pays once (the first READ of each P -> D pair costs 1-2 s on this machine; the
    first request of a validation level took 0.3 s longer than a later one of the same length) is paid here, as
    the simulator, which models none of it, assumes."""

    words: int
    requests: int
    max_tokens: int = 8


def with_free_router_port(config: ClusterConfig) -> ClusterConfig:
    """The same cluster with its router on a free port (tests and other engineers may hold 8000)."""
    router = config.router.model_copy(update={"port": None})
    return config.model_copy(update={"router": router})


class RealCluster:
    """A started cluster (context manager) that sweeps loadgen workloads against its router."""

    def __init__(self, config: ClusterConfig, log_dir: Path) -> None:
        self.cluster = Cluster(with_free_router_port(config), Path(log_dir))

    def __enter__(self) -> RealCluster:
        self.cluster.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    def sweep(self, workload: Workload, scenario: str, levels: list[int], duration_s: float, out_dir: Path,
              seed: int = 0, drain_s: float = 120.0, max_requests: int | None = None, slo: SLO | None = None,
              gpus: int | None = None) -> Summary:
        target = Target(self.cluster.router_url, self.cluster.model_name)
        opts = SweepOptions(target=target, concurrency_levels=levels, duration_s=duration_s, out_dir=Path(out_dir),
                            seed=seed, slo=slo or SLO(), gpus=gpus, drain_s=drain_s, max_requests=max_requests,
                            plots=False, command=["sim.measure", scenario])
        return asyncio.run(run_sweep(workload, opts, scenario, []))


    def warm_up(self, warmups: tuple[Warmup, ...], out_dir: Path) -> None:
        """Send each `Warmup`'s requests (loadgen summaries under `out_dir`/warmup-WORDS)."""
        for w in warmups:
            workload = RandomWorkload(RandomConfig(seed=WARMUP_SEED, input_len=parse_dist(str(w.words)),
                                                   output_len=parse_dist(str(w.max_tokens))))
            self.sweep(workload, "random", [1], 1e6, Path(out_dir) / f"warmup-{w.words}", max_requests=w.requests,
                       drain_s=600.0)

    def token_gaps(self, node: str) -> tuple[float, int]:
        """`histogram_totals` of the node's `TOKEN_GAPS` so far (its /metrics)."""
        return self.node_totals(node, TOKEN_GAPS)

    def node_totals(self, node: str, name: str) -> tuple[float, int]:
        """`histogram_totals` of the node's histogram `name` so far (its /metrics)."""
        import httpx

        reply = httpx.get(self.cluster.metrics_urls[node], timeout=60.0)
        reply.raise_for_status()
        return histogram_totals(reply.text, name)

    @contextmanager
    def background(self, words: int, max_tokens: int, seed: int) -> Iterator[list[float]]:
        """Keep one request at a time running through the router (a prompt of `words` fresh random words, each a
        new prefix), from entry until exit, which waits for the one in flight; yields the list of the finished
        requests' latencies (s). What a calibration point measures beside it is the cost of sharing the cores."""
        import time

        import httpx

        from loadgen.text import words as draw_words

        stop, done, failed = threading.Event(), [], []
        rng = random.Random(seed)
        body = {"model": self.cluster.model_name, "max_tokens": max_tokens, "ignore_eos": True, "stream": False}

        def run() -> None:
            try:
                with httpx.Client(base_url=self.cluster.router_url, timeout=600.0) as client:
                    while not stop.is_set():
                        started = time.monotonic()
                        reply = client.post("/v1/chat/completions", json={
                            **body, "messages": [{"role": "user", "content": draw_words(rng, words)}]})
                        if reply.status_code != 200:
                            failed.append(f"{reply.status_code}: {reply.text[:200]}")
                            return
                        done.append(time.monotonic() - started)
            except httpx.HTTPError as exc:
                failed.append(f"{type(exc).__name__}: {exc}")

        thread = threading.Thread(target=run, name="calibrate-background", daemon=True)
        thread.start()
        while not done and not failed and thread.is_alive():  # the background is running before the point starts
            time.sleep(0.05)
        why = "no request finished" if not failed else failed[0]
        if failed or not done:
            stop.set()
            raise RuntimeError(f"background load ({words} words, {max_tokens} tokens) failed: {why}")
        try:
            yield done
        finally:
            stop.set()
            thread.join(timeout=600.0)
        if failed:  # the point ran beside a load that stopped part way
            raise RuntimeError(f"background load ({words} words, {max_tokens} tokens) failed: {failed[0]}")


def measure(config: ClusterConfig, workload: Workload, scenario: str, levels: list[int], duration_s: float,
            out_dir: Path, warmups: tuple[Warmup, ...] = (), **kw) -> Summary:
    """Start the cluster, send the warm-up requests, sweep once, stop it."""
    out_dir = Path(out_dir)
    with RealCluster(config, out_dir / "logs") as real:
        real.warm_up(warmups, out_dir)
        return real.sweep(workload, scenario, levels, duration_s, out_dir, **kw)
