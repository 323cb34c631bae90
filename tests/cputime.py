"""Per-test wall time and CPU time, this pytest process and every process under it (an opt-in pytest plugin).

    pytest -p tests.cputime --cputime-report=FILE ...

A test's CPU time is the growth, over its set-up, call and teardown, of the CPU that the process tree rooted at this
pytest process has used: this process and the children it reaped (`resource.getrusage`) plus every live descendant
(utime + stime + the cutime + cstime of the children it reaped, from /proc/<pid>/stat). A shared topology started
by one test and used by the next is charged to each for what it burns while that test runs. Other users of the
machine are not counted, unlike the /proc/stat idle figures. A process that dies unreaped by its parent (a killed
process group's grandchildren, re-parented to init) takes its CPU out of the tree: the test in which it dies is
charged minus what it had used (the tests before are right; a sum that includes that test loses the process).

`cpu / wall` tells a test that waits (sleeps, polls, timeouts: near 0) from one that computes (near 1 or above on
two cores). `others_cpu_s` is what every other process on the machine used meanwhile (/proc/stat), i.e. the
contention the figures were taken under, and `idle_s` the CPU time no process used (cores x wall - both): a
test with idle CPU beside it was waiting, not starved. Under pytest-xdist each worker writes FILE.<worker id>, and
each worker's tree holds only its own tests' processes. The report is tab-separated, slowest first: wall_s, cpu_s,
cpu/wall, others_cpu_s, idle_s, start_unix_s (when the test's set-up began: lines up the workers' files), nodeid; a
per-file sum follows.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone between listing and reading
        return None
    return text[text.rindex(")") + 2:].split()  # fields from 3 (state) on; the name may hold spaces


def _descendants_cpu_s(root: int) -> float:
    """CPU seconds of every live descendant of `root` (not `root` itself), with what each has reaped."""
    children: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is None:
            continue
        ppid = int(fields[1])
        ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime (fields 14-17)
        children[ppid].append((int(entry), ticks * _TICK_S))
    total, stack = 0.0, [root]
    while stack:
        for pid, cpu_s in children.get(stack.pop(), ()):
            total += cpu_s
            stack.append(pid)
    return total


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process, its reaped children and its live descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
            + _descendants_cpu_s(os.getpid()))


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (the non-idle jiffies of /proc/stat), for contention."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    ticks = [int(f) for f in fields]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) * _TICK_S


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cputime-report", metavar="FILE", default=None,
                     help="write each test's wall and CPU seconds (process tree) to FILE (tests/cputime.py)")


class _Recorder:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[tuple[float, float, float, float, str]] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        start, wall0, cpu0, busy0 = time.time(), time.monotonic(), tree_cpu_s(), machine_busy_s()
        try:
            return (yield)
        finally:
            cpu_s = tree_cpu_s() - cpu0
            self.rows.append((time.monotonic() - wall0, cpu_s, machine_busy_s() - busy0 - cpu_s, start, item.nodeid))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.path is None or not self.rows:
            return
        per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
        for wall, cpu, others, _, nodeid in self.rows:
            acc = per_file[nodeid.split("::")[0]]
            for i, value in enumerate((wall, cpu, others, 1)):
                acc[i] += value
        cores = sum(line[3:4].isdigit() for line in Path("/proc/stat").read_text().splitlines())  # cpuN lines
        lines = ["wall_s\tcpu_s\tcpu/wall\tothers_cpu_s\tidle_s\tstart_unix_s\tnodeid"]
        lines += [f"{w:.2f}\t{c:.2f}\t{c / w if w else 0:.2f}\t{o:.2f}\t{cores * w - c - o:.2f}\t{t:.1f}\t{n}"
                  for w, c, o, t, n in sorted(self.rows, reverse=True)]
        lines += ["", "wall_s\tcpu_s\tcpu/wall\tothers_cpu_s\tidle_s\tnum_tests\tfile"]
        lines += [f"{w:.2f}\t{c:.2f}\t{c / w if w else 0:.2f}\t{o:.2f}\t{cores * w - c - o:.2f}\t{k}\t{f}"
                  for f, (w, c, o, k) in sorted(per_file.items(), key=lambda kv: -kv[1][0])]
        self.path.write_text("\n".join(lines) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    report = config.getoption("--cputime-report")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # one file per xdist worker: FILE.gw0, FILE.gw1
    path = Path(f"{report}.{worker}" if worker else report) if report else None
    config.pluginmanager.register(_Recorder(path), "cputime-recorder")
