"""The simulated nodes' cache reports, kept per session, equal the engine's full recomputation at every poll of a
run with evictions (small pools), tails and sessions coming and going, in the same order (most recent first:
the router's eviction of its oldest note depends on it), whether polled often or seldom (reports built from the
last one, patched)."""

from __future__ import annotations

import pytest

from loadgen.lengths import parse_dist
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload
from sim.cluster import SimCluster
from sim.driver import run_level
from tests.sim.helpers import cluster, profile


def _naive(inst) -> tuple[list, list]:  # noqa: ANN001 - SimInstance
    cache = inst.cache
    recent = list(reversed(inst.sessions.items()))
    held = [(s, cache.held_tokens(k)) for s, (k, _) in recent]
    resumable = [(s, cache.held_tokens(k, snapshot=True, tails=t)) for s, (k, t) in recent]
    return [(s, v) for s, v in held if v], [(s, v) for s, v in resumable if v]


@pytest.mark.parametrize("every_s", [0.05, 0.7, 5.0], ids=["often", "each-second", "seldom"])
def test_kept_reports_equal_the_full_recomputation(every_s: float) -> None:
    config = cluster({"num_rows": 40, "max_step_tokens": 256}, decode_pools=(("tp", 1, 1), ("dcp", 1, 2)))
    returned: list[tuple[list, dict, list, dict]] = []
    sim = SimCluster(config, profile(base_s=0.01, token_s=1e-5, seq_s=1e-3, kind="bytes"))
    checks = []

    def check() -> None:
        for inst in sim.instances.values():
            report = inst.cache_report()
            assert (list(report.sessions.items()), list(report.resumable.items())) == _naive(inst)
            returned.append((list(report.sessions.items()), report.sessions, list(report.resumable.items()),
                             report.resumable))
            checks.append(len(report.sessions))
        if sim.loop.now < 100:
            sim.loop.after(every_s, check)

    sim.loop.after(every_s, check)
    workload = AgentXWorkload(AgentXConfig(seed=4, system_len=parse_dist("120"), task_len=parse_dist("60"),
                                           tool_len=parse_dist("80"), output_len=parse_dist("8"),
                                           think_s=parse_dist("exp:0.2"), max_context=1500))
    level = run_level(sim, workload, 6, 100.0, 60.0)
    assert level.records and sum(inst.cache.counters.evicted_blocks for inst in sim.instances.values()) > 0
    assert max(checks) > 0
    for held, held_map, resumable, resumable_map in returned:  # a report handed out is never changed afterwards
        assert list(held_map.items()) == held and list(resumable_map.items()) == resumable
