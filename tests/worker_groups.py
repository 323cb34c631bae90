"""`pytest -n N --dist loadgroup`: every test marked `xdist_group(name)` runs on one worker, in collection order,
the others one module per unit (a pytest plugin, loaded by tests/conftest.py).

pytest-xdist 3.8 tells its scheduler a test's group by appending "@name" to `item._nodeid`, which pytest 9 no longer
reads (a node's id is `item._id`): its loadgroup silently ran every test as its own unit, so a module-scoped or
shared fixture started once per worker. Here each worker writes {node id: group} after collection and selection
to a file the controller named, and the controller's scheduler (xdist's LoadScopeScheduling, largest unit first)
reads it once every worker has collected, which is before it splits the run into units. Units start in xdist's order
(most tests first), except that the named groups start before every module: with two workers and two groups, each
worker starts with one of them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

GROUPS_FILE_KEY = "pdcluster_groups_file"
"""workerinput key: where a worker writes its {node id: group}."""


def _groups_file(config: pytest.Config) -> Path | None:
    return getattr(config, "_pdcluster_groups_file", None)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.getoption("dist", default=None) != "loadgroup":
        return
    config._pdcluster_groups_file = Path(tempfile.mkdtemp(prefix="pytest-groups-")) / "groups.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    path = _groups_file(config)
    if path is not None:
        path.unlink(missing_ok=True)
        path.parent.rmdir()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001 (xdist's WorkerController)
    path = _groups_file(node.config)
    if path is not None:
        node.workerinput[GROUPS_FILE_KEY] = str(path)


def _group(item: pytest.Item) -> str:
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    return "_".join(names) if names else item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)  # after selection (-m, -k) and after tests/topologies.py marked the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    target = getattr(config, "workerinput", {}).get(GROUPS_FILE_KEY)
    if target is None:
        return
    scratch = Path(f"{target}.{config.workerinput['workerid']}")
    scratch.write_text(json.dumps({item.nodeid: _group(item) for item in items}))
    os.replace(scratch, target)  # every worker writes the same map; a reader never sees half of one


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    path = _groups_file(config)
    if path is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with the groups the workers wrote as scopes."""

        def __init__(self) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # first called once every worker has collected (schedule())
                self._groups = json.loads(path.read_text())
            return self._groups[nodeid]

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 (xdist's WorkerController)
            # Named groups first (xdist orders units by their number of tests): they hold the clusters, the
            # longest units, so each starts on a worker of its own at once and the modules fill in around them.
            for scope in [scope for scope in self.workqueue if not scope.endswith(".py")][::-1]:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return GroupScheduling()
