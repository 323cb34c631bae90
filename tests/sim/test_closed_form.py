"""The simulator against answers known in closed form: M/D/1 queueing on one decode instance, a closed loop of
decode-only requests, the M/D/1 wait in an open loop, exact step arithmetic."""

from __future__ import annotations

import random

import pytest

from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload
from loadgen.lengths import parse_dist
from loadgen.scenarios.trace import TraceEntry, TraceWorkload
from sim.run import SimOptions, simulate
from tests.sim.helpers import cluster, profile

NO_PLEG = {"disagg_min_uncached_tokens": 1_000_000}
"""Every request colocated on the decode instance (conditional disaggregation never sends a P leg)."""
ONE_STEP = {"max_step_tokens": None, "prefix_cache": False, "num_rows": 4096}


def _trace(rate: float, n: int, input_len: int, seed: int = 0) -> TraceWorkload:
    rng = random.Random(seed)
    t, entries = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        entries.append(TraceEntry(i + 1, t, input_len, 1, ()))
    return TraceWorkload(entries, "poisson", block_tokens=64)


def _run(workload, conc: int, duration: float, prof, decode_settings=ONE_STEP, **kw):
    opts = SimOptions(concurrency_levels=[conc], duration_s=duration, out_dir=None, drain_s=1e6, **kw)
    return simulate(cluster(decode_settings, NO_PLEG), prof, workload, workload.name, opts).summary.levels[0]


def test_mdl_mean_wait_matches_pollaczek_khinchine() -> None:
    """Poisson arrivals, every request one prefill step of D seconds and one token: M/D/1, so the mean time
    to first token is D + rho D / (2 (1 - rho))."""
    d, rho, n = 0.05, 0.6, 20_000
    prof = profile(base_s=d)
    level = _run(_trace(rho / d, n, 32), conc=n, duration=1e9, prof=prof)
    assert level.num_ok == n
    expected = d + rho * d / (2 * (1 - rho))
    assert level.ttft_ms.mean / 1000 == pytest.approx(expected, rel=0.04)
    assert level.ttft_ms.min / 1000 == pytest.approx(d, abs=1e-12)  # an arrival to an idle node waits for nothing


def test_step_cost_is_linear_in_prompt_tokens() -> None:
    """One request alone: TTFT = router + decode leg + base + token_s * prompt tokens (words template: BOS + words)."""
    from sim.profile import HttpCost

    prof = profile(base_s=0.01, token_s=0.001, http=HttpCost(router_s=0.002, decode_leg_s=0.003))
    level = _run(_trace(1.0, 1, 100), conc=1, duration=100, prof=prof)
    assert level.ttft_ms.p50 / 1000 == pytest.approx(0.002 + 0.003 + 0.01 + 0.001 * 101, abs=1e-12)


def test_a_chunk_pays_for_its_cached_prefix() -> None:
    """One request alone on a DCP=2 decode instance prefilling its 1,024 tokens (words template: BOS + 1,023
    words) in chunks of 256: every step pays base + prefix_s per token before its chunk (the DCP prefill gathers
    the whole prefix first), so TTFT = 4 base + prefix_s * 256 * (0 + 1 + 2 + 3)."""
    d, g = 0.05, 2e-5
    prof = profile(base_s=d, prefix_s=g)
    settings = {"max_step_tokens": 256, "prefix_cache": False, "num_rows": 4096}
    opts = SimOptions(concurrency_levels=[1], duration_s=100, out_dir=None, drain_s=1e6)
    config = cluster(settings, NO_PLEG, decode_pools=(("dcp", 1, 2),))
    level = simulate(config, prof, _trace(1.0, 1, 1023), "poisson", opts).summary.levels[0]
    assert level.ttft_ms.p50 / 1000 == pytest.approx(4 * d + g * 256 * 6, abs=1e-12)


def test_closed_loop_decode_batch_throughput() -> None:
    """N closed-loop users, no think time, T output tokens each, every step (prefill, decode or both) D seconds.
    The N first prefills take one step each, so the users run staggered by one step; a request's prefill step
    emits its first token and T-1 decode steps the rest; its successor reaches the node while the next step is
    already running (an event at the instant a step starts joins the following one), so a user's cycle is T + 1
    steps: throughput N T / ((T + 1) D) while N <= T + 1 keeps the prefills from colliding, TPOT exactly D."""
    d, n_users, t_out = 0.02, 4, 9
    prof = profile(base_s=d)
    workload = RandomWorkload(RandomConfig(seed=1, input_len=parse_dist("8"), output_len=parse_dist(str(t_out))))
    level = _run(workload, conc=n_users, duration=60.0, prof=prof)
    assert level.tpot_ms.p50 / 1000 == pytest.approx(d, rel=1e-9)
    assert level.tpot_ms.p99 / 1000 == pytest.approx(d, rel=1e-9)
    assert level.output_tok_s == pytest.approx(n_users * t_out / ((t_out + 1) * d), rel=0.005)
