"""Orphan-free supervision with real child processes: trees stop on SIGTERM, stragglers get SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.process import descendants, kill_tree, spawn, stop_tree

pytestmark = pytest.mark.process

FAKE_NODE = Path(__file__).with_name("fake_node.py")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _wait_pids(child, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in child.log_path.read_text().splitlines():
            if line.startswith("PIDS "):
                return [int(x) for x in line.split()[1:]]
        time.sleep(0.05)
    raise AssertionError(f"fake node printed no pids:\n{child.log_tail()}")


def _start(tmp_path: Path, port: int, **env: str):
    child = spawn("fake", [sys.executable, str(FAKE_NODE), "--port", str(port)], env, tmp_path / "fake.log")
    return child, _wait_pids(child)


def test_stop_tree_reaches_ranks_in_other_sessions(tmp_path, port):
    child, pids = _start(tmp_path, port)
    assert set(pids[1:]) <= set(descendants(child.pid))
    assert os.getpgid(child.pid) == child.pid  # own process group
    assert os.getsid(pids[2]) == pids[2]  # the second rank escaped into its own session
    code = stop_tree(child, grace_s=5.0)
    assert code == -signal.SIGTERM
    assert not any(_alive(pid) for pid in pids)


def test_stop_tree_kills_a_child_that_ignores_sigterm(tmp_path, port):
    child, pids = _start(tmp_path, port, FAKE_IGNORE_TERM="1")
    started = time.monotonic()
    code = stop_tree(child, grace_s=1.0)
    assert code == -signal.SIGKILL and 0.9 < time.monotonic() - started < 8.0
    assert not any(_alive(pid) for pid in pids)


def test_kill_tree_is_immediate(tmp_path, port):
    child, pids = _start(tmp_path, port)
    kill_tree(child)
    assert child.popen.returncode == -signal.SIGKILL
    assert not any(_alive(pid) for pid in pids)


def test_children_die_with_a_killed_launcher(tmp_path, port):
    """A SIGKILLed launcher cannot clean up; the parent-death signal still takes its children down."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from cluster.process import spawn\n"
        f"child = spawn('fake', [sys.executable, {str(FAKE_NODE)!r}, '--port', '{port}'], {{}}, "
        f"Path({str(tmp_path / 'fake.log')!r}))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[2])
    node_pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 20
    while "PIDS" not in (tmp_path / "fake.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(node_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(node_pid)
    # The node's own ranks are the node's job to stop (real nodes do); clean up the fake's.
    for pid in _wait_pids(type("C", (), {"log_path": tmp_path / "fake.log", "log_tail": lambda self: ""})())[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_child_outlives_the_thread_that_spawned_it(tmp_path, port):
    """PR_SET_PDEATHSIG fires when the *thread* that forked a child ends (prctl(2)): a node restarted from a
    fault schedule's thread used to get SIGTERM (and drain away) as soon as that thread returned."""
    import threading

    started = []
    thread = threading.Thread(target=lambda: started.append(_start(tmp_path, port)))
    thread.start()
    thread.join()
    child, pids = started[0]
    try:
        time.sleep(1.0)  # the parent-death signal, if sent, arrives at once; the fake exits on SIGTERM
        assert child.is_alive(), f"the child died with its spawning thread (code {child.popen.returncode})"
    finally:
        stop_tree(child, grace_s=5.0)
    assert not any(_alive(pid) for pid in pids)
