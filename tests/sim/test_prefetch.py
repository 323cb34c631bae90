"""Sessions drawn ahead by worker processes (sim/prefetch.py) are the workload's own, value for value, and a level
run with them gives the same records as one drawing every session in the simulator's process."""

from __future__ import annotations

import pytest

from loadgen.lengths import parse_dist
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload
from sim.prefetch import PrefetchedSessions
from sim.run import SimOptions, simulate
from tests.sim.helpers import cluster, profile

# forks worker processes (multiprocessing, fork start method)
pytestmark = pytest.mark.process


def _workload() -> AgentXWorkload:
    return AgentXWorkload(AgentXConfig(seed=5, system_len=parse_dist("200"), task_len=parse_dist("40"),
                                       tool_len=parse_dist("uniform:1,60"), output_len=parse_dist("uniform:4,24"),
                                       turns=parse_dist("uniform:2,5"), subagent_prob=0.4, think_s=parse_dist("0.5"),
                                       max_context=4000))


@pytest.mark.parametrize("workers", [1, 3])
def test_prefetched_sessions_equal_the_workloads(workers: int) -> None:
    workload = _workload()
    with PrefetchedSessions(workload, workers, depth=2) as prefetched:
        assert prefetched.is_open_loop is False
        got = [prefetched.session(k) for k in range(12)]
        assert got == [workload.session(k) for k in range(12)]
        assert prefetched.session(3) == workload.session(3)  # out of order: served here, workers stopped
        assert prefetched.session(12) == workload.session(12)


def test_prefetch_rejects_no_workers() -> None:
    with pytest.raises(ValueError, match="at least 1, got 0"):
        PrefetchedSessions(_workload(), 0)


def test_level_with_session_workers_gives_the_same_records() -> None:
    def records(workers: int) -> list:
        opts = SimOptions(concurrency_levels=[6], duration_s=12.0, out_dir=None, session_workers=workers)
        result = simulate(cluster({"max_step_tokens": 256, "num_rows": 256}), profile(base_s=0.004, token_s=2e-6),
                          _workload(), "agentx", opts)
        return sorted((r.model_dump() for r in result.summary.levels[0].records), key=lambda r: r["request_id"])

    plain = records(0)
    assert len(plain) > 20 and all(r["outcome"] == "ok" for r in plain)
    assert records(2) == plain
