"""Fixtures shared by every test package: free ports, the repo root, one torch thread per process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import engine.ports

REPO_ROOT = Path(__file__).resolve().parent.parent


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
