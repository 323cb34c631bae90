"""Fixtures for loadgen tests: a real uvicorn process serving the streaming stub (a test double)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import REPO_ROOT, free_port


@dataclass
class Stub:
    url: str
    proc: subprocess.Popen

    def configure(self, **config) -> None:
        """Replace the stub's config (unset fields reset to defaults) and clear its log and counter."""
        httpx.post(f"{self.url}/stub/config", json=config, timeout=5).raise_for_status()

    def log(self) -> list[dict]:
        return httpx.get(f"{self.url}/stub/log", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_stub() -> Stub:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.loadgen.stub_server", "--port", str(port)],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stub = Stub(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stub server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{stub.url}/v1/models", timeout=0.5).status_code == 200:
                return stub
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stub.stop()
    raise RuntimeError("stub server did not answer within 20 s")


@pytest.fixture(scope="session")
def stub_server():
    stub = start_stub()
    yield stub
    stub.stop()


@pytest.fixture
def stub(stub_server: Stub) -> Stub:
    """The shared stub, reset to default timing for this test."""
    stub_server.configure()
    return stub_server
