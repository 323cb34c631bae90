"""Process supervision without orphans: each child in its own process group, stopped as a tree.

Every process starts with `start_new_session=True` (its own session and process group, so a terminal's
Ctrl-C reaches only the launcher, which then stops children in order) and with a parent-death signal
(`PR_SET_PDEATHSIG`, Linux), so even a SIGKILLed launcher takes its direct children down. The kernel sends that
signal when the *thread* that forked the child ends (prctl(2)), not the process: `spawn` therefore forks each child
from a keeper thread of its own that lives until the child exits, so a node restarted from a short-lived thread (a
fault schedule, a worker pool) is not stopped when that thread returns.

`stop_tree` sends SIGTERM to the child's process group and to every descendant found under /proc (rank
processes that started their own group included), waits up to a grace period, then SIGKILLs whatever
is left. `drain_tree` first sends SIGTERM to the child alone (a node then drains: it stops admitting and lets
its in-flight requests finish while its rank processes keep running), waits for it to exit, and only then
stops what is left of the tree. Logs go to one file per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """A started process: its name, the Popen handle and where its output goes."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])


def spawn(name: str, argv: tuple[str, ...] | list[str], env: dict[str, str], log_path: Path,
          cwd: Path | None = None) -> Child:
    """Start `argv` in its own process group with `env` added, output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"=== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        log.flush()
        popen = _popen_kept(name, lambda: subprocess.Popen(
            list(argv), env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent,
        ))
    return Child(name=name, popen=popen, log_path=log_path)


def _popen_kept(name: str, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """`start()` run on a daemon thread that then waits, without reaping, until the child exits: the child's
    parent-death signal follows that thread (module docstring), which ends only with the child or the launcher."""
    started: list[subprocess.Popen | BaseException] = []
    ready = threading.Event()

    def keep() -> None:
        try:
            popen = start()
        except BaseException as exc:  # handed to the caller below
            started.append(exc)
            ready.set()
            return
        started.append(popen)
        ready.set()
        try:  # WNOWAIT leaves the exit status to Popen (poll/wait in the caller's threads)
            os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped by Popen
            pass

    threading.Thread(target=keep, name=f"pdcluster-keep-{name}", daemon=True).start()
    ready.wait()
    if isinstance(started[0], BaseException):
        raise started[0]
    return started[0]


def _parent_map() -> dict[int, int]:
    """pid -> parent pid for every process, from /proc."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_map().items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _signal_all(pids: list[int], pgid: int | None, sig: signal.Signals) -> None:
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2:].split()[0] != "Z"


def stop_tree(child: Child, grace_s: float = 10.0, sig: signal.Signals = signal.SIGTERM,
              extra: list[int] | tuple[int, ...] = ()) -> int | None:
    """Stop `child` and everything it started (and `extra` pids, found earlier): `sig`, then SIGKILL after
    `grace_s`. Returns its exit code."""
    tree = [child.pid, *descendants(child.pid), *(pid for pid in extra if _alive(pid))]
    pgid = child.pid  # start_new_session makes the child its own group leader
    _signal_all(tree, pgid, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        child.popen.poll()
        if not any(_alive(pid) for pid in tree):
            break
        time.sleep(0.05)
    else:
        tree += descendants(child.pid)
        _signal_all(tree, pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            child.popen.poll()
            time.sleep(0.02)
    try:
        return child.popen.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


def drain_tree(child: Child, drain_s: float, grace_s: float = 10.0) -> int | None:
    """SIGTERM to `child` only; wait up to `drain_s` for it to exit (a node drains meanwhile), then `stop_tree`
    whatever is left (its rank processes, or the child itself if it overran). Returns its exit code."""
    known = descendants(child.pid)  # a descendant in its own session is found through the child only
    if child.is_alive():
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            child.popen.wait(timeout=drain_s)
        except subprocess.TimeoutExpired:
            pass
    return stop_tree(child, grace_s if child.is_alive() else min(grace_s, 5.0), extra=known)


def kill_tree(child: Child) -> None:
    """SIGKILL `child` and its descendants at once (a crash, for fault tests)."""
    stop_tree(child, grace_s=0.0, sig=signal.SIGKILL)
