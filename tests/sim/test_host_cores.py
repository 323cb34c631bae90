"""Core sharing on one CPU host (sim/instance.py `HostCores`), in closed form: every node pins its rank r to core
r mod cores (node/executor.py), so a step stretches by the busy ranks on the most loaded of its own cores."""

from __future__ import annotations

import pytest

from sim.instance import HostCores


def test_ranks_share_the_cores_they_are_pinned_to() -> None:
    """The default topology on two cores: P (TP=2) on cores 0 and 1, D tp (TP=1) on core 0, D dcp (DCP=2) on
    cores 0 and 1. A pooled count (busy ranks / cores) would say 1.5 where core 0 holds two busy ranks."""
    host = HostCores(2)
    assert host.start(2) == 1.0  # P alone: one rank per core
    assert host.start(1) == 2.0  # D tp beside it: core 0 holds P rank 0 and tp's rank
    assert host.sharing(2) == 2.0  # P's lockstep step waits for its rank on core 0
    assert host.start(2) == 3.0  # D dcp too: core 0 holds three busy ranks, core 1 two
    assert host.busy == [3, 2]
    host.end(2)  # P done
    assert host.sharing(1) == 2.0 and host.sharing(2) == 2.0
    host.end(1)
    assert host.sharing(2) == 1.0
    host.end(2)
    assert host.busy == [0, 0]


def test_more_ranks_than_cores_wrap_around() -> None:
    """A TP=4 instance on two cores puts two of its ranks on each: alone it already stretches by 2."""
    host = HostCores(2)
    assert host.start(4) == 2.0
    assert host.start(1) == 3.0
    assert host.busy == [3, 2]


def test_no_sharing_without_host_cores() -> None:
    """GPU profiles (host_cores None): instances never slow each other."""
    host = HostCores(None)
    assert host.start(8) == 1.0 and host.start(8) == 1.0 and host.sharing(8) == 1.0
    host.end(8)
    host.end(8)


def test_a_decode_step_beside_a_prefill_takes_twice_as_long() -> None:
    """A whole cluster: one request decodes on the TP=1 instance while another's long prefill runs on the TP=2
    prefill instance; the decode steps inside the prefill take 2 D (core 0 is shared), the ones outside it D."""
    from loadgen.scenarios.trace import TraceEntry, TraceWorkload
    from sim.run import SimOptions, simulate
    from tests.sim.helpers import cluster, profile

    d, token_s = 0.01, 0.001
    prof = profile(base_s=d, token_s=token_s).model_copy(update={"host_cores": 2})
    # request 1: 8 words, 200 tokens (decodes from about 0.02 s to 2 s); request 2 at 0.5 s: 1000 words, a
    # prefill of about 1 s on P (tp2: two ranks), colocated decode settings keep every prompt disaggregated
    entries = [TraceEntry(1, 0.0, 8, 200, ()), TraceEntry(2, 0.5, 1000, 2, ())]
    workload = TraceWorkload(entries, "two", block_tokens=64)
    cfg = cluster({"max_step_tokens": None, "num_rows": 4096}, {"disagg_min_uncached_tokens": 0})
    level = simulate(cfg, prof, workload, "trace", SimOptions([2], 100.0, None, drain_s=1e6)).summary.levels[0]
    first = next(r for r in level.records if r.request_id.endswith("1"))
    gaps = [b - a for a, b in zip(first.chunk_s[1:], first.chunk_s[2:])]  # its first token left with its second
    assert {round(g / d, 6) for g in gaps} == {1.0, 2.0}
    second = next(r for r in level.records if r.request_id.endswith("2"))
    overlap = second.start_s < first.chunk_s[-1] and first.chunk_s[1] < second.start_s
    assert overlap and sum(round(g / d) == 2 for g in gaps) > 50  # the prefill spans many of its steps


def test_contention_scales_what_sharing_adds() -> None:
    """A step beside k - 1 other busy ranks on its most loaded core takes 1 + contention * (k - 1) times its time:
    0.5 (half of it waits on peers) gives 1.5 at k = 2, 1.25 (it loses more than its share) 3.5 at k = 3."""
    from sim.profile import StepCost

    assert StepCost(tp=1, base_s=0.01).stretched(2) == 2.0
    assert StepCost(tp=1, base_s=0.01, contention=0.5).stretched(2) == 1.5
    assert StepCost(tp=1, base_s=0.01, contention=1.25).stretched(3) == 3.5
    assert StepCost(tp=1, base_s=0.01, contention=0.0).stretched(3) == 1.0
    assert StepCost(tp=1, base_s=0.01, contention=0.7).stretched(1) == 1.0


def test_a_decode_step_beside_a_prefill_with_contention() -> None:
    """The cluster of the test above with the TP=1 decode's contention at 1.5: its steps inside the prefill take
    2.5 D."""
    from loadgen.scenarios.trace import TraceEntry, TraceWorkload
    from sim.profile import StepCost
    from sim.run import SimOptions, simulate
    from tests.sim.helpers import cluster, profile

    d = 0.01
    base = profile(base_s=d, token_s=0.001)
    steps = [s.model_copy(update={"contention": 1.5}) if (s.tp, s.dcp) == (1, 1) else s for s in base.steps]
    prof = base.model_copy(update={"host_cores": 2, "steps": steps})
    assert isinstance(prof.steps[0], StepCost)
    entries = [TraceEntry(1, 0.0, 8, 200, ()), TraceEntry(2, 0.5, 1000, 2, ())]
    cfg = cluster({"max_step_tokens": None, "num_rows": 4096}, {"disagg_min_uncached_tokens": 0})
    level = simulate(cfg, prof, TraceWorkload(entries, "two", block_tokens=64), "trace",
                     SimOptions([2], 100.0, None, drain_s=1e6)).summary.levels[0]
    first = next(r for r in level.records if r.request_id.endswith("1"))
    gaps = [b - a for a, b in zip(first.chunk_s[1:], first.chunk_s[2:])]
    assert {round(g / d, 6) for g in gaps} == {1.0, 2.5}
