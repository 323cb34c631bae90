"""The simulator's import path loads no torch: the real scheduler, prefix cache and row bookkeeping it runs need
none (engine/rows.py), and torch's import was about 1.5 s of CPU in every simulated run (benchmarks/sim_speed.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.process
def test_simulator_imports_no_torch() -> None:
    # A fresh interpreter: this test process may have imported torch already.
    code = ("import sys; import sim.run, sim.planner, sim.profile, sim.cli, benchmarks.sim_speed; "
            "from sim.instance import SimInstance; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
