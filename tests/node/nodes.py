"""Helpers for node tests: real node processes (`pdcluster prefill|decode`) on free ports."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import httpx

from tests.conftest import REPO_ROOT, free_port

TOY = "tests.node.toy_backend:build_engine"
START_TIMEOUT_S = 900.0  # rank processes import torch and start NIXL; slow when the machine is busy
TEST_CLUSTER_SECRET = "pdcluster-test-cluster-secret-0123456789"
"""Every node these helpers start shares it (a node without a cluster secret refuses to start)."""
SECRET_ENV = {"PREFILL_CLUSTER_SECRET": TEST_CLUSTER_SECRET, "DECODE_CLUSTER_SECRET": TEST_CLUSTER_SECRET}


@dataclass
class Node:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-4000:]


def control_auth(secret: str | bytes = TEST_CLUSTER_SECRET) -> httpx.Auth:
    """httpx auth that signs a request to a node's control routes (/abort_requests, /v1/cache, /kv/...) as a member
    of the cluster does (kv_transfer/cluster_auth.py)."""
    from kv_transfer.cluster_auth import ClusterAuth
    from kv_transfer.signing import ClusterSecret

    return ClusterAuth(ClusterSecret(secret.encode() if isinstance(secret, str) else secret))


def signed(params: dict, secret: str = TEST_CLUSTER_SECRET) -> dict:
    """`params` (a prefill node's kv_transfer_params, altered by a test) signed again with the test cluster secret:
    what a genuine prefill node would have sent, so the decode node's later checks are what a test exercises."""
    from kv_transfer.params import KVTransferParams
    from kv_transfer.signing import ClusterSecret, sign

    fields = {k: v for k, v in params.items() if k != "signature"}
    return sign(KVTransferParams.model_validate(fields), ClusterSecret(secret.encode())).to_wire()


def wait_healthy(node: Node, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node exited with code {node.proc.returncode}; log:\n{node.log()}")
        try:
            if httpx.get(f"{node.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{node.url} not healthy within {timeout_s} s; log:\n{node.log()}")


def start_node(kind: str, args: list[str], env: dict[str, str] | None = None, test_secret: bool = True) -> Node:
    """A node process on a free port (returns at once: `wait_healthy`); `test_secret=False` leaves the cluster
    secret to `env` (a node joining a cluster that has its own)."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                **(SECRET_ENV if test_secret else {}), **(env or {})}
    cmd = [sys.executable, "-m", "pdcluster.cli", kind, "--host", "127.0.0.1", "--port", str(port), *args]
    log = tempfile.NamedTemporaryFile(prefix=f"pdcluster-{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=full_env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return Node(f"http://127.0.0.1:{port}", proc, log.name)


def stop_node(node: Node) -> None:
    node.proc.terminate()
    try:
        node.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        node.proc.kill()
        node.proc.wait(timeout=10)
    os.unlink(node.log_path)


@contextmanager
def running_nodes(*specs: tuple[str, list[str], dict[str, str] | None]) -> Iterator[list[Node]]:
    """Start every (kind, args, env) node at once, wait until all are healthy, stop them all at the end."""
    nodes = [start_node(kind, args, env) for kind, args, env in specs]
    try:
        for node in nodes:
            wait_healthy(node)
        yield nodes
    finally:
        for node in nodes:
            stop_node(node)
