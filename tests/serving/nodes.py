"""Helpers for node tests: settings with a chosen backend, real node processes on free ports."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import httpx

from tests.conftest import REPO_ROOT, free_port

TOY = "tests.serving.toy_backend:build_backend"


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"node exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


@contextmanager
def node_process(kind: str, args: list[str], env: dict[str, str] | None = None,
                 timeout_s: float = 120.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `pdcluster <kind> ... --port P` as a real process; yield (base url, process); stop it."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "pdcluster.cli", kind, "--host", "127.0.0.1", "--port", str(port), *args]
    log = tempfile.NamedTemporaryFile(prefix=f"pdcluster-{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=full_env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; log:\n{open(log.name).read()[-3000:]}") from exc
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
        os.unlink(log.name)
