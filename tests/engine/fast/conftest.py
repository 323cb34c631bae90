"""Fast-kernel tests run on the device (`gpu` marker, CUDA) or on CPU through the Triton interpreter
(TRITON_INTERPRET=1, set by this conftest before triton is imported when no CUDA device is present). Without the
triton package every test here is skipped, saying so."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="the fast kernels need the triton package")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present (the `gpu` runs), else CPU under the Triton interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    """On a CUDA machine Triton compiles the kernels with ptxas, a subprocess: the tests here carry `process`."""
    if not torch.cuda.is_available():
        return
    here = str(__file__).rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.process)
