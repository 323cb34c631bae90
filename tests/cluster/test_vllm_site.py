"""cluster/vllm_site/sitecustomize.py in vLLM's own virtualenv: NIXL's progress thread gets the delay, and an idle
agent stops spending a core (the CPU of a whole interpreter is measured, so a busy loop anywhere would show)."""

from __future__ import annotations

import os
import subprocess

import pytest

from cluster.plan import VLLM_SITE_DIR
from tests.vllm_fixtures import require_vllm

pytestmark = pytest.mark.process

IDLE_S = 2.0
_AGENT = f"""
import time
import nixl._api as api
agent = api.nixl_agent("idle", api.nixl_agent_config(num_threads=4, capture_telemetry=True))
print("config-class", api.nixlBind.nixlAgentConfig.__name__)
start = time.process_time()
time.sleep({IDLE_S})
print("idle-cpu-s", time.process_time() - start)
"""


def _start_idle_agent(delay_us: str | None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(VLLM_SITE_DIR)}
    env.pop("PDCLUSTER_NIXL_PROGRESS_DELAY_US", None)
    if delay_us is not None:
        env["PDCLUSTER_NIXL_PROGRESS_DELAY_US"] = delay_us
    return subprocess.Popen([str(require_vllm()), "-c", _AGENT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen) -> tuple[str, float]:
    """(the bindings' config class name, CPU seconds the interpreter used while its agent sat idle)."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    said = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("config-class", "idle-cpu")))
    return said["config-class"], float(said["idle-cpu-s"])


def test_an_idle_vllm_nixl_agent_sleeps_with_the_delay_and_spins_without():
    # both at once (each measures its own process's CPU): the test's time is one interpreter start, not two
    delayed, plain = _start_idle_agent("2000"), _start_idle_agent(None)
    (patched, with_delay), (plain_class, without) = _said(delayed), _said(plain)
    assert patched == "_DelayedConfig" and plain_class == "nixlAgentConfig"
    # The delayed thread sleeps in poll() between passes; NIXL's own busy loop spins, and gets what share of a core
    # the machine leaves it: 0.41 s of the 2 s beside `make test`'s three process-test workers (load ~5), so the
    # spin is told by its ratio to the delayed agent's CPU, not by a share of a core
    assert with_delay < 0.25 * IDLE_S, (with_delay, without)
    assert without > 10 * max(with_delay, 0.01), (with_delay, without)


@pytest.mark.parametrize("value", ["-5", "2ms"])
def test_a_bad_delay_stops_the_interpreter_at_start(value):
    env = {**os.environ, "PYTHONPATH": str(VLLM_SITE_DIR), "PDCLUSTER_NIXL_PROGRESS_DELAY_US": value}
    run = subprocess.run([str(require_vllm()), "-c", "print('ran')"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "ran" not in run.stdout
    assert f"PDCLUSTER_NIXL_PROGRESS_DELAY_US must be an integer >= 0, got '{value}'" in run.stderr
