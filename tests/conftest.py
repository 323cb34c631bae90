"""Fixtures shared by every test package: free ports, the repo root, one torch thread per process, and the
`process` marker's guard.

`process` marks every test that starts a process or a server (subprocesses, rank processes, uvicorn, helm,
promtool, vLLM); `make test-fast` runs the rest. `e2e` tests carry it implicitly. A test without the marker
that starts one anyway (a subprocess, a multiprocessing process, or a listening socket, in its fixtures'
set-up, its body or its teardown) fails, naming what it started.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.ports

REPO_ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.topologies", "tests.worker_groups"]
"""The run's shared topologies (`cluster`, `vllm_cluster`, `vllm_pd_pair`, `decode_tp2`) and the test order; under
`-n 2 --dist loadgroup`, which tests share a worker."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (below the ephemeral range: engine/ports.py)."""
    return engine.ports.free_port()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread per process: two cores shared by rank processes thrash otherwise, and
    # bit-identity between runs needs a fixed reduction order.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # the router-only test environment has no torch
        pass


PROCESS_STARTS = ((subprocess.Popen, "_execute_child", "a subprocess"),
                  (multiprocessing.process.BaseProcess, "start", "a process (multiprocessing)"),
                  (socket.socket, "listen", "a server (a listening socket)"))
"""What a test without the `process` marker may not start: (owner, method, what it starts)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("process"):
            item.add_marker(pytest.mark.process)


@contextlib.contextmanager
def _no_process_starts(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("process"):
        yield
        return

    def refusal(what: str):  # noqa: ANN202
        def refuse(*_args, **_kwargs):  # noqa: ANN202
            raise RuntimeError(f"{item.nodeid} starts {what} but is not marked `process` "
                               "(@pytest.mark.process: `make test-fast` leaves such tests out)")
        return refuse

    saved = [(owner, name, owner.__dict__[name] if name in owner.__dict__ else None)
             for owner, name, _ in PROCESS_STARTS]
    for owner, name, what in PROCESS_STARTS:
        setattr(owner, name, refusal(what))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _no_process_starts(item):
        return (yield)
