"""A running cluster as tests and scripts see it: URLs, nodes, faults, metrics and the oracle.

`ClusterHandle` wraps a started `Cluster`:
- `router_url`, `metrics_urls` (router + every node), `nodes` (role, pool, url, pid, ...), `model`;
- faults: `kill(node)` (SIGKILL the node's process tree), `kill_rank(node, index)` (one rank process),
  `restart(node)` (same command line, waits for /health), `stop()`;
- `metrics(name)`: the parsed `/metrics` of one process, `wait_until(...)`: bounded polling;
- `oracle(prompt, max_tokens)`: greedy tokens from `pdcluster generate --json` (one rank, the numerical
  oracle), cached per (prompt, max_tokens); `oracle_chat(messages, ...)` applies the reference chat
  template (special role ids) and runs the same generation code on those ids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster.launcher import Cluster, NodeInfo
from cluster.process import descendants
from tests.oracle import generate, generate_text


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Metrics:
    """Every sample of one `/metrics` scrape."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        found = [Sample(s.name, dict(s.labels), s.value)
                 for family in text_string_to_metric_families(text) for s in family.samples]
        return cls(tuple(found))

    def get(self, name: str, **labels: str) -> float | None:
        """Sum of the samples named `name` whose labels include `labels`; None if there is none."""
        values = [s.value for s in self.samples
                  if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(values) if values else None

    def value(self, name: str, **labels: str) -> float:
        """Like `get`, but a missing series is an error naming it."""
        found = self.get(name, **labels)
        if found is None:
            names = sorted({s.name for s in self.samples})
            raise KeyError(f"no sample {name}{labels or ''} in /metrics (series: {', '.join(names[:60])})")
        return found


@dataclass(frozen=True)
class NodeLoad:
    """A node's request and row counts from its /metrics."""

    running: float
    waiting: float
    rows_used: float
    leases: float

    @property
    def is_quiet(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.leases == 0


@dataclass(frozen=True)
class OracleResult:
    text: str
    token_ids: tuple[int, ...]
    raw: dict = field(default_factory=dict, compare=False)


class ClusterHandle:
    """What the e2e `cluster` fixture yields."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._oracle_cache: dict[tuple[str, int], OracleResult] = {}

    @property
    def router_url(self) -> str:
        return self.cluster.router_url

    @property
    def model(self) -> str:
        return self.cluster.model_name

    @property
    def metrics_urls(self) -> dict[str, str]:
        return self.cluster.metrics_urls

    @property
    def nodes(self) -> list[NodeInfo]:
        return self.cluster.nodes

    @property
    def control_auth(self):
        """httpx auth signing a request to a node's control routes with this cluster's secret."""
        from tests.node.nodes import control_auth

        return control_auth(self.cluster.secret_path.read_text().strip())

    def node(self, name: str) -> NodeInfo:
        return self.cluster.info(name)

    def nodes_of(self, role: str | None = None, pool: str | None = None) -> list[NodeInfo]:
        return [n for n in self.nodes if (role is None or n.role == role) and (pool is None or n.pool == pool)]

    @staticmethod
    def _name(node: NodeInfo | str) -> str:
        return node if isinstance(node, str) else node.name

    def stop(self) -> None:
        self.cluster.stop()

    def kill(self, node: NodeInfo | str) -> None:
        self.cluster.kill(self._name(node))

    def restart(self, node: NodeInfo | str, timeout_s: float | None = None) -> NodeInfo:
        return self.cluster.restart(self._name(node), timeout_s)

    def rank_pids(self, node: NodeInfo | str) -> list[int]:
        """Processes the node started (its rank workers), oldest first."""
        return sorted(descendants(self.node(self._name(node)).pid))

    def kill_rank(self, node: NodeInfo | str, index: int = -1) -> int:
        """SIGKILL one process below the node (a rank crash); returns its pid."""
        pids = self.rank_pids(node)
        if not pids:
            raise RuntimeError(f"{self._name(node)} has no child processes to kill")
        pid = pids[index]
        os.kill(pid, signal.SIGKILL)
        return pid

    def metrics(self, name: str = "router", timeout_s: float = 10.0) -> Metrics:
        response = httpx.get(self.metrics_urls[name], timeout=timeout_s)
        response.raise_for_status()
        return Metrics.parse(response.text)

    @staticmethod
    def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.25) -> None:
        """Poll `predicate` until true; AssertionError naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def client(self, timeout_s: float = 180.0):
        """The official OpenAI client pointed at the router (no retries: tests see every failure)."""
        import openai

        return openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="none", max_retries=0, timeout=timeout_s)

    def async_client(self, timeout_s: float = 300.0):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.router_url}/v1", api_key="none", max_retries=0, timeout=timeout_s)

    def node_load(self, name: str) -> NodeLoad:
        m = self.metrics(name)
        return NodeLoad(running=m.value("vllm:num_requests_running"), waiting=m.value("vllm:num_requests_waiting"),
                        rows_used=m.value("pdcluster_node_kv_rows_used"),
                        leases=m.get("pdcluster_node_leases_outstanding") or 0.0)

    def loads(self) -> dict[str, NodeLoad]:
        return {node.name: self.node_load(node.name) for node in self.nodes}

    def idle_snapshot(self, timeout_s: float = 120.0) -> dict[str, NodeLoad]:
        """Wait until no node runs, queues or leases anything; return every node's load then."""
        self.wait_until(lambda: all(load.is_quiet for load in self.loads().values()), timeout_s,
                        "every node to be idle")
        return self.loads()

    def wait_back_to(self, idle: dict[str, NodeLoad], timeout_s: float = 120.0) -> None:
        """Wait until every node is quiet with the row count of `idle`; the error shows what differs."""
        try:
            self.wait_until(lambda: self.loads() == idle, timeout_s, "nodes back to their idle counts")
        except AssertionError:
            raise AssertionError(f"nodes not back to idle after {timeout_s:.0f} s:\n idle: {idle}\n now: {self.loads()}")

    def router_sees_healthy(self, name: str) -> bool | None:
        """The router's `pdcluster_instance_healthy` for `name` (None when it exports none)."""
        value = self.metrics("router").get("pdcluster_instance_healthy", instance=name)
        return None if value is None else value >= 1.0

    def oracle(self, prompt: str, max_tokens: int) -> OracleResult:
        """Greedy continuation of `prompt` as `pdcluster generate --json` gives it on one rank (tests/oracle.py:
        the same engine code in this process)."""
        key = (prompt, max_tokens)
        if key not in self._oracle_cache:
            self._oracle_cache[key] = _result(generate_text(prompt, max_tokens, model=self.cluster.config.model,
                                                            device=self.cluster.config.device))
        return self._oracle_cache[key]

    def oracle_chat(self, messages: list[dict], max_tokens: int) -> OracleResult:
        """The oracle for a chat request: the reference chat template (special role ids, as the nodes apply
        it), then `oracle`'s generation on those ids."""
        from engine.model.tokenizer import ByteTokenizer, ChatMessage

        ids = ByteTokenizer().apply_chat_template([ChatMessage(m["role"], m["content"]) for m in messages])
        key = (json.dumps(ids), max_tokens)
        if key not in self._oracle_cache:
            self._oracle_cache[key] = _result(generate(ids, max_tokens, model=self.cluster.config.model,
                                                       device=self.cluster.config.device))
        return self._oracle_cache[key]


def choice_token_ids(choice: object) -> list[int] | None:
    """`token_ids` of a completion choice (an extra field the nodes return, vLLM-style), if present."""
    extra = getattr(choice, "model_extra", None) or {}
    found = extra.get("token_ids", getattr(choice, "token_ids", None))
    return list(found) if found is not None else None


def _result(data: dict) -> OracleResult:
    return OracleResult(text=data["text"], token_ids=tuple(data["token_ids"]), raw=data)


def run_oracle(python: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0,
               device: str = "cpu") -> OracleResult:
    """One `pdcluster generate --json` run (on the cluster's device); raises with its stderr when it fails."""
    argv = [python, "-m", "pdcluster.cli", "generate", "--model", model, "--prompt", prompt,
            "--max-tokens", str(max_tokens), "--json", "--device", device]
    return _run_generate(argv, timeout_s)


def _run_generate(argv: list[str], timeout_s: float) -> OracleResult:
    # cwd: the repo root (from tests/, the test package tests/engine would shadow engine/)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0:
        raise RuntimeError(f"pdcluster generate failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    token_ids = data.get("token_ids", data.get("output_token_ids", ()))
    return OracleResult(text=data["text"], token_ids=tuple(token_ids), raw=data)
