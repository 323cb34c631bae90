"""sim/measure.py's warm-up, without a cluster."""

from __future__ import annotations

from pathlib import Path

from loadgen.lengths import parse_dist
from sim.measure import WARMUP_SEED, RealCluster, Warmup


def test_warm_up_sends_each_warmups_requests_before_anything_else(tmp_path) -> None:
    """Two 300-word prompts then one of 1,400 words (benchmarks/sim_validation.py's WARMUP), one at a time, from
    the warm-up's own word stream, each set's summary in its own folder."""
    sent = []
    real = RealCluster.__new__(RealCluster)  # no cluster started: sweep is replaced
    real.sweep = lambda workload, scenario, levels, duration_s, out_dir, **kw: sent.append(
        (workload.config.seed, workload.config.input_len, levels, kw["max_requests"], Path(out_dir).name))
    real.warm_up((Warmup(300, 2), Warmup(1400, 1)), tmp_path)
    assert sent == [(WARMUP_SEED, parse_dist("300"), [1], 2, "warmup-300"),
                    (WARMUP_SEED, parse_dist("1400"), [1], 1, "warmup-1400")]
