"""Cluster lifecycle and `pdcluster up` with real processes (fake_node.py in place of each server).

The interpreter of every command line is replaced by a wrapper that runs fake_node.py, so the launcher's
real code paths run: spawn, health polling, startup failure, kill/restart, SIGTERM to `pdcluster up`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.config import parse_config
from cluster.launcher import Cluster, ClusterStartError

pytestmark = pytest.mark.process

FAKE_NODE = Path(__file__).with_name("fake_node.py")
REPO = Path(__file__).resolve().parents[2]
POOLS = [{"name": "prefill", "role": "prefill", "tp": 2}, {"name": "tp", "role": "decode"},
         {"name": "dcp", "role": "decode", "dcp": 2}]


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    wrapper = tmp_path / "fakepy"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_NODE} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _pids_in(log: Path) -> list[int]:
    return [int(x) for line in log.read_text().splitlines() if line.startswith("PIDS ") for x in line.split()[1:]]


def _all_pids(log_dir: Path) -> list[int]:
    return [pid for log in log_dir.glob("*.log") for pid in _pids_in(log)]


def _start_up(tmp_path: Path, fake_python: str) -> tuple[subprocess.Popen, Path, str]:
    """`pdcluster up` on POOLS with fake nodes; (process, log dir, output up to the banner's last line)."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"startup_timeout_s": 30, "pools": POOLS}))
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cli", "up", "--config", str(tmp_path / "c.yaml"), "--router-port", "0",
         "--log-dir", str(logs), "--node-python", fake_python],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if not line or line.startswith("Ctrl-C stops"):
            break
    return proc, logs, "".join(lines)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _none_alive(pids: list[int], within_s: float = 10.0) -> bool:
    """No pid alive within `within_s`: a rank forked while its node was being stopped gets its death signal from
    the kernel as the node exits, which may land just after the launcher returns."""
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_start_kill_restart_stop(tmp_path, fake_python):
    config = parse_config({"router": {"port": None}, "startup_timeout_s": 30, "pools": POOLS})
    cluster = Cluster(config, tmp_path / "logs", python=fake_python).start()
    try:
        assert [(n.name, n.role, n.pool) for n in cluster.nodes] == [
            ("prefill-0", "prefill", "prefill"), ("tp-0", "decode", "tp"), ("dcp-0", "decode", "dcp")]
        assert set(cluster.metrics_urls) == {"router", "prefill-0", "tp-0", "dcp-0"}
        for url in cluster.metrics_urls.values():
            assert httpx.get(url, timeout=5).status_code == 200
        registry = yaml.safe_load(cluster.router_config_path.read_text())
        assert [i["url"] for i in registry["instances"]] == [n.url for n in cluster.nodes]
        old_pid = cluster.info("tp-0").pid
        cluster.kill("tp-0")
        assert cluster.dead() == ["tp-0"]
        restarted = cluster.restart("tp-0")
        assert restarted.pid != old_pid and httpx.get(f"{restarted.url}/health", timeout=5).status_code == 200
        assert cluster.dead() == []
    finally:
        cluster.stop()
    pids = _all_pids(tmp_path / "logs")
    assert len(pids) == 5 * 3  # 4 processes + one restart, each with two ranks
    assert not any(_alive(pid) for pid in pids)


def test_a_node_dying_at_startup_stops_the_rest(tmp_path, fake_python):
    pools = [POOLS[0], dict(POOLS[1], env={"FAKE_EXIT_CODE": "3"}), dict(POOLS[2], env={"FAKE_HEALTH_DELAY_S": "60"})]
    config = parse_config({"router": {"port": None}, "startup_timeout_s": 30, "pools": pools})
    cluster = Cluster(config, tmp_path / "logs", python=fake_python)
    with pytest.raises(ClusterStartError, match="tp-0 exited with code 3 during startup"):
        cluster.start()
    assert "router" not in cluster.children
    assert _none_alive(_all_pids(tmp_path / "logs"))


def test_startup_is_bounded(tmp_path, fake_python):
    pools = [POOLS[0], dict(POOLS[1], env={"FAKE_HEALTH_DELAY_S": "60"})]
    config = parse_config({"router": {"port": None}, "startup_timeout_s": 2, "pools": pools})
    started = time.monotonic()
    with pytest.raises(ClusterStartError, match="not healthy within 2 s: tp-0"):
        Cluster(config, tmp_path / "logs", python=fake_python).start()
    assert time.monotonic() - started < 15
    assert not any(_alive(pid) for pid in _all_pids(tmp_path / "logs"))


def test_pdcluster_up_prints_endpoint_and_stops_on_sigterm(tmp_path, fake_python):
    proc, logs, text = _start_up(tmp_path, fake_python)
    assert "pdcluster is up: http://127.0.0.1:" in text and "curl -s http://127.0.0.1:" in text, text
    assert f"logs:    {logs}" in text and "/metrics" in text
    router_url = text.split("pdcluster is up: ")[1].split("/v1")[0]
    assert httpx.get(f"{router_url}/health", timeout=5).status_code == 200
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "every process stopped" in out
    pids = _all_pids(logs)
    assert len(pids) == 4 * 3 and not any(_alive(pid) for pid in pids)


def test_a_port_already_in_use_is_refused_before_anything_starts(tmp_path, fake_python):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = parse_config({"router": {"port": port}, "startup_timeout_s": 30, "pools": POOLS})
        cluster = Cluster(config, tmp_path / "logs", python=fake_python)
        with pytest.raises(ClusterStartError, match=f"ports already in use: router \\(127.0.0.1:{port}\\)"):
            cluster.start()
    assert cluster.children == {}


def test_pdcluster_up_stops_everything_when_the_router_dies(tmp_path, fake_python):
    proc, logs, _ = _start_up(tmp_path, fake_python)
    for pid in _pids_in(logs / "router.log"):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "the router is gone" in out and "every process stopped" in out, out
    assert not any(_alive(pid) for pid in _all_pids(logs))


def test_pdcluster_up_rejects_a_bad_config(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"pools": [dict(POOLS[0], tp=3), POOLS[1]]}))
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cli", "up", "--config", str(tmp_path / "c.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pools[0].tp: must be a power of two" in proc.stderr


def test_pdcluster_up_vllm_needs_a_model_dir():
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cli", "up", "--engine", "vllm", "--model", "/no/such"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs --model DIR" in proc.stderr
