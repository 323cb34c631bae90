"""The simulated router's prompt estimate, kept per turn: a turn adds its new messages' figures to the estimate of
the turn it extends (sim/cluster.py `SimCluster.prompt_estimate`), which equals the router's estimate of the whole
body."""

from __future__ import annotations

import random

import pytest

from loadgen.lengths import parse_dist
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload
from loadgen.schedule import Fork, RequestSpec
from router.session_routing import prompt_estimate
from sim.cluster import SimCluster
from tests.sim.helpers import cluster, profile


def _specs(steps) -> list[RequestSpec]:  # noqa: ANN001 - a session's steps
    out = []
    for step in steps:
        if isinstance(step, Fork):
            for branch in step.branches:
                out += _specs(branch)
        else:
            out.append(step)
    return out


@pytest.mark.parametrize("kind", ["words", "bytes"])
def test_turn_estimates_equal_the_routers_on_the_whole_body(kind: str) -> None:
    sim = SimCluster(cluster(), profile(kind=kind))
    workload = AgentXWorkload(AgentXConfig(seed=3, system_len=parse_dist("300"), task_len=parse_dist("40"),
                                           tool_len=parse_dist("uniform:1,60"), turns=parse_dist("6"),
                                           subagent_prob=0.5, max_context=100_000))
    rng = random.Random(1)
    num_checked = 0
    for index in range(20):
        estimates: list[tuple[RequestSpec, int]] = []
        for spec in _specs(workload.session(index).steps):
            body = {"messages": [{"role": m.role, "content": m.content} for m in spec.messages]}
            earlier = next(((len(e.messages), est) for e, est in reversed(estimates)
                            if spec.messages[:len(e.messages)] == e.messages), None)
            if rng.random() < 0.2:
                earlier = None  # from scratch, as a turn whose earlier prompt was forgotten
            got = sim.prompt_estimate(spec.messages, earlier)
            assert got == prompt_estimate(sim.state, body)
            estimates.append((spec, got))
            num_checked += earlier is not None
    assert num_checked > 50
