"""`-n 2 --dist loadgroup` with tests/worker_groups.py keeps a marked group on one worker, in collection order, and
an unmarked module on one worker (its module-scoped fixture starts once), as `make test`'s process tier needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.process  # runs a pytest with two xdist workers

_SUITE = '''
import os
import pytest

RECORD = os.environ["GROUPS_RECORD"]


def _record(name):
    with open(RECORD, "a") as fh:
        fh.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name}\\n")


@pytest.mark.parametrize("i", range(12))
@pytest.mark.xdist_group("cluster")
def test_grouped_a(i):
    _record(f"grouped {i:02d}")


@pytest.mark.parametrize("i", range(12, 24))
@pytest.mark.xdist_group("cluster")
def test_grouped_b(i):
    _record(f"grouped {i:02d}")


@pytest.mark.parametrize("i", range(24))
def test_free(i):
    _record(f"free {i}")
'''


def _run(tmp_path: Path) -> list[tuple[str, str]]:
    """Run the suite in `tmp_path` on two workers; (worker id, what) for each test, in the order they ran."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    record = tmp_path / "record.txt"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.worker_groups", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "-q", str(tmp_path)],
        cwd=tmp_path, env={"PYTHONPATH": f"{REPO_ROOT}:{tmp_path}", "GROUPS_RECORD": str(record),
                           "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [tuple(line.split(" ", 1)) for line in record.read_text().splitlines()]


def test_a_group_and_a_module_each_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(_SUITE)
    (tmp_path / "test_module.py").write_text(textwrap.dedent('''
        import pytest
        from test_suite import _record

        @pytest.fixture(scope="module")
        def started():
            _record("fixture")

        @pytest.mark.parametrize("i", range(24))
        def test_uses_module_fixture(started, i):
            _record("module")
    '''))
    record = _run(tmp_path)
    workers: dict[str, set[str]] = defaultdict(set)
    grouped: list[str] = []
    for worker, what in record:
        workers[what.split(" ")[0]].add(worker)
        if what.startswith("grouped"):
            grouped.append(what)
    assert len(workers["grouped"]) == 1, f"the `cluster` group ran on {sorted(workers['grouped'])}"
    assert grouped == sorted(grouped), "the group ran out of collection order"
    assert len(workers["module"]) == 1, f"one module ran on {sorted(workers['module'])}"
    assert [what for _, what in record].count("fixture") == 1, "the module-scoped fixture started more than once"
    assert len(workers["free"] | workers["module"] | workers["grouped"]) == 2, "one worker got no work"


def test_groups_start_first_one_per_worker(tmp_path: Path) -> None:
    """Two small groups and a larger module: each worker starts with a group (the groups hold the long tests: the
    clusters), though xdist would order the units by their number of tests."""
    (tmp_path / "test_suite.py").write_text(textwrap.dedent('''
        import os
        import pytest

        def _record(name):
            with open(os.environ["GROUPS_RECORD"], "a") as fh:
                fh.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name}\\n")

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.xdist_group("first")
        def test_first(i):
            _record(f"first {i}")

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.xdist_group("second")
        def test_second(i):
            _record(f"second {i}")
        '''))
    (tmp_path / "test_module.py").write_text(textwrap.dedent('''
        import pytest
        from test_suite import _record

        @pytest.mark.parametrize("i", range(24))
        def test_free(i):
            _record(f"free {i}")
        '''))
    record = _run(tmp_path)
    first_of = {}
    for worker, what in record:
        first_of.setdefault(worker, what.split(" ")[0])
    assert sorted(first_of.values()) == ["first", "second"], f"each worker's first test: {first_of}"
