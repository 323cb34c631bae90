"""The simulator's speed work keeps every figure: the records of 30 simulated seconds of the sim_speed benchmark's
cluster and workload (sim/configs/gb300-64.yaml, sim/workloads/agentx-gb300.yaml, profile gb300-k31-pro, no chunk
times) hash to the value they had before the speed passes' last changes (sha256 of every record's JSON, in order).
A change that moves any record, time or count fails here; a deliberate modelling change of the GB300 profile or
of this workload updates the pinned hash and says why in its commit."""

from __future__ import annotations

import hashlib

from cluster.config import load_config
from loadgen.cli_run import build_workload
from sim.planner import load_workload
from sim.profile import resolve_profile
from sim.run import SimOptions, simulate
from tests.conftest import REPO_ROOT

PINNED_SHA256 = "ed891e9fbc0570e6b95b82c5083d0265f5f32affb02fa460eb4096d5a1a7297c"
"""Computed on main b0a6d5c (before engine/rows.py and the records' model_validate), and equal after them."""


def test_gb300_agentx_slice_records_are_unchanged() -> None:
    spec = load_workload(REPO_ROOT / "sim" / "workloads" / "agentx-gb300.yaml")
    workload, _ = build_workload(spec.args)
    config = load_config(REPO_ROOT / "sim" / "configs" / "gb300-64.yaml")
    opts = SimOptions([spec.concurrency], 30.0, None, seed=spec.seed, gpus=64, record_chunks=False,
                      schedule_units=1)
    result = simulate(config, resolve_profile("gb300-k31-pro"), workload, "agentx", opts)
    records = result.summary.levels[0].records
    digest = hashlib.sha256()
    for record in records:
        digest.update(record.model_dump_json().encode())
    assert (sum(r.is_ok for r in records), result.num_events) == (1534, 11643)
    assert digest.hexdigest() == PINNED_SHA256
