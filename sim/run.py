"""A simulated sweep: loadgen's levels on a `SimCluster`, summarised and written by loadgen's own code.

`simulate(config, profile, workload, options)` runs each concurrency level one after another on one cluster
(caches stay warm between levels, as on a real cluster), summarises each with `loadgen.metrics.summarize_level`
and writes summary.json / report.md (and plots) through `loadgen.sweep.finish`, so `pdcluster loadgen compare`
reads a simulated run like a measured one. `RunInfo.url` is `sim:CONFIG@PROFILE`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ClusterConfig
from loadgen.client import Target
from loadgen.metrics import summarize_level
from loadgen.schedule import Workload
from loadgen.slo import SLO
from loadgen.summary import Summary
from loadgen.sweep import SweepOptions, finish, new_summary
from sim.cluster import SimCluster
from sim.driver import run_level
from sim.profile import Profile


@dataclass
class SimOptions:
    concurrency_levels: list[int]
    duration_s: float
    out_dir: Path | None
    seed: int = 0
    slo: SLO | None = None
    gpus: int | None = None
    gpu_split: tuple[int, int] | None = None
    drain_s: float = 60.0
    max_requests: int | None = None
    schedule_units: int = 64
    plots: bool = False
    record_chunks: bool = True
    session_workers: int = 0
    """Worker processes drawing a closed loop's sessions ahead (sim/prefetch.py; 0: drawn in this process)."""
    command: list[str] | None = None
    config_name: str = "config"


@dataclass
class SimResult:
    summary: Summary
    wall_s: float
    simulated_s: float
    num_events: int
    busy_s: dict[str, float]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while the levels run, and one collection after. A simulated hour holds
    millions of live objects (cache blocks, sessions, records); each full pass of the collector walks them all,
    and it ran about a thousand times per simulated five minutes (a quarter of the CPU time) to find next to
    nothing: the simulator's objects are freed by reference counts (its events, flows and requests form no
    cycles that outlive a request). The objects built before the run are frozen out of the collections. After
    the run every object joins the oldest generation (freeze, then unfreeze: no pass over them, where a collection
    here walked millions of live objects, 3-4% of an hour's CPU time); a cycle left behind goes at the next full
    collection, at the latest when the next level starts."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def simulate(config: ClusterConfig, profile: Profile, workload: Workload, scenario: str,
             opts: SimOptions) -> SimResult:
    wall0 = time.perf_counter()
    cluster = SimCluster(config, profile, record_chunks=opts.record_chunks)
    target = Target(f"sim:{opts.config_name}@{profile.name}", config.model)
    sweep = SweepOptions(target=target, concurrency_levels=opts.concurrency_levels, duration_s=opts.duration_s,
                         out_dir=opts.out_dir or Path("."), seed=opts.seed, slo=opts.slo or SLO(), gpus=opts.gpus,
                         gpu_split=opts.gpu_split, drain_s=opts.drain_s, max_requests=opts.max_requests,
                         schedule_units=opts.schedule_units, plots=opts.plots, command=opts.command or [])
    summary = new_summary(workload, sweep, scenario)
    for conc in opts.concurrency_levels:
        with _collector_paused():
            level = run_level(cluster, workload, conc, opts.duration_s, opts.drain_s, opts.max_requests,
                                  opts.session_workers)
        summary.levels.append(summarize_level(conc, level.records, level.duration_s, sweep.slo, opts.gpus,
                                              level.started_s, opts.gpu_split))
    summary.refresh()
    if opts.out_dir is not None:
        finish(summary, sweep)
    return SimResult(summary, time.perf_counter() - wall0, cluster.loop.now, cluster.loop.num_events,
                     cluster.busy_s())
