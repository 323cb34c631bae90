"""Start, watch, restart and stop a whole cluster on this machine.

`Cluster(config, log_dir).start()` starts every prefill and decode instance, waits (bounded by
`startup_timeout_s`) until each answers `GET /health` with 200, then writes the router's registry file and
starts the router and waits for it too. If any process exits during startup, or the bound passes, every
process already started is stopped and `ClusterStartError` says which one failed with its log tail.
`stop()` stops the router first, then drains the nodes: SIGTERM to each node process alone (it stops admitting
and finishes what it serves, node/serving.py), and once it exited, whatever is left of its process tree
(cluster/process.py).

Per cluster, the launcher also provides what reference nodes need beyond their command line, as environment:
- a cluster secret, generated at start into `<log dir>/cluster.secret` (mode 0600), named by
  `PREFILL_/DECODE_/ROUTER_CLUSTER_SECRET_FILE` (never the secret itself on a command line); hand-offs and the
  control requests between the router and the nodes (kv_transfer/cluster_auth.py) are signed with it;
- `DECODE_PREFILL_PEERS`: the reference prefill instances and the other reference decode instances (whose streams
  it takes over with their KV when they drain: decode_node/moves.py), the only ones a decode node reads from;
- `PREFILL_/DECODE_METRICS_PORT`: a separate /metrics port per node (`metrics_urls` points there).
A pool's own `env` / `settings` naming any of these wins.

The same object serves `pdcluster up` and the e2e `cluster` fixture (kill / restart of one node).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from cluster.config import ClusterConfig
from cluster.plan import ProcessPlan, assign_ports, plan_nodes, plan_router, router_config, served_model_name
from cluster.process import Child, drain_tree, kill_tree, spawn, stop_tree
from engine.ports import free_port, is_port_free


ROUTER_MIN_STARTUP_S = 90.0
"""Least time the router gets to answer /health after the nodes are up, whatever is left of the bound."""


NODE_DRAIN_WAIT_S = 65.0
"""How long `stop()` waits for a draining node (its default drain_s, 55 s, plus its shutdown)."""
ENV_PREFIX = {"prefill": "PREFILL_", "decode": "DECODE_"}


class ClusterStartError(RuntimeError):
    """A process died or stayed unhealthy during startup; the message carries its log tail."""


@dataclass(frozen=True)
class NodeInfo:
    """What tests and operators need to know about one running process."""

    name: str
    role: str
    pool: str
    url: str
    pid: int
    tp: int
    dcp: int
    engine: str
    log_path: Path


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class Cluster:
    """The processes of one cluster, started from a validated config."""

    def __init__(self, config: ClusterConfig, log_dir: Path, python: str = sys.executable) -> None:
        self.config = config
        self.log_dir = Path(log_dir)
        self.python = python
        ports = assign_ports(config)
        self.router_config_path = self.log_dir / "router.yaml"
        self.node_plans = plan_nodes(config, ports, python)
        self.router_plan = plan_router(config, ports, self.router_config_path, python)
        self.plans: dict[str, ProcessPlan] = {plan.name: plan for plan in [*self.node_plans, self.router_plan]}
        self.children: dict[str, Child] = {}
        self.secret_path = self.log_dir / "cluster.secret"
        taken = {plan.port for plan in self.plans.values()}
        self.metrics_ports = {plan.name: free_port(plan.host, taken) for plan in self.node_plans
                              if plan.engine == "reference"}
        """Each reference node's separate /metrics port."""

    @property
    def router_url(self) -> str:
        return self.router_plan.url

    @property
    def model_name(self) -> str:
        return served_model_name(self.config)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """`/metrics` of the router and every node, by process name (a reference node's metrics port)."""
        return {name: (f"http://{plan.host}:{self.metrics_ports[name]}/metrics" if name in self.metrics_ports
                       else plan.metrics_url) for name, plan in self.plans.items()}

    @property
    def nodes(self) -> list[NodeInfo]:
        """Every started prefill and decode instance (not the router)."""
        return [self.info(plan.name) for plan in self.node_plans if plan.name in self.children]

    def info(self, name: str) -> NodeInfo:
        plan, child = self.plans[name], self.children[name]
        return NodeInfo(name=name, role=plan.role, pool=plan.pool, url=plan.url, pid=child.pid, tp=plan.tp,
                        dcp=plan.dcp, engine=plan.engine, log_path=child.log_path)

    def start(self) -> "Cluster":
        """Start nodes, wait for them, start the router, wait for it. Stops everything on failure."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # A port already served (say, by an earlier cluster's router) would answer /health for a process that
        # is about to fail to bind: refuse before starting anything.
        busy = [f"{name} ({plan.host}:{plan.port})" for name, plan in self.plans.items()
                if not is_port_free(plan.host, plan.port)]
        busy += [f"{name} metrics ({self.plans[name].host}:{port})" for name, port in self.metrics_ports.items()
                 if not is_port_free(self.plans[name].host, port)]
        if busy:
            raise ClusterStartError(f"ports already in use: {', '.join(busy)}; stop what holds them or choose "
                                    "other ports (router.port, pools[].ports)")
        deadline = time.monotonic() + self.config.startup_timeout_s
        self._write_secret()
        try:
            for plan in self.node_plans:
                self._spawn(plan)
            self.wait_healthy([plan.name for plan in self.node_plans], deadline)
            registry = router_config(self.config, self.node_plans)
            self.router_config_path.write_text(yaml.safe_dump(registry, sort_keys=False))
            self._spawn(self.router_plan)
            # The router gets its own minimum bound: slow nodes must not leave it no time at all.
            self.wait_healthy(["router"], max(deadline, time.monotonic() + ROUTER_MIN_STARTUP_S))
        except BaseException:
            self.stop()
            raise
        return self

    def _write_secret(self) -> None:
        """A fresh cluster secret, readable by this user only (created 0600, never world-readable)."""
        self.secret_path.unlink(missing_ok=True)
        fd = os.open(self.secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(48))

    def node_env(self, plan: ProcessPlan) -> dict[str, str]:
        """What the launcher adds to a reference node's environment, or the router's (see the module docstring)."""
        if plan.role == "router":  # it signs its calls to the nodes' control routes, whatever engines they run
            given = {**os.environ, **plan.env}
            return {} if "ROUTER_CLUSTER_SECRET_FILE" in given else {"ROUTER_CLUSTER_SECRET_FILE": str(self.secret_path)}
        prefix = ENV_PREFIX.get(plan.role)
        if plan.engine != "reference" or prefix is None:
            return {}
        given = {**os.environ, **plan.env}
        env = {}
        if f"{prefix}CLUSTER_SECRET" not in given and f"{prefix}CLUSTER_SECRET_FILE" not in given:
            env[f"{prefix}CLUSTER_SECRET_FILE"] = str(self.secret_path)
        if f"{prefix}METRICS_PORT" not in given and plan.name in self.metrics_ports:
            env[f"{prefix}METRICS_PORT"] = str(self.metrics_ports[plan.name])
        if plan.role == "decode" and "DECODE_PREFILL_PEERS" not in given:
            peers = [f"{p.host}:{p.port}" for p in self.node_plans if p.engine == "reference" and (
                p.role == "prefill" or (p.role == "decode" and p.name != plan.name))]  # decode: moves on drain
            env["DECODE_PREFILL_PEERS"] = json.dumps(peers)
        return env

    def _spawn(self, plan: ProcessPlan) -> Child:
        child = spawn(plan.name, plan.argv, {**self.node_env(plan), **plan.env}, self.log_dir / f"{plan.name}.log")
        self.children[plan.name] = child
        return child

    def wait_healthy(self, names: list[str], deadline: float) -> None:
        """Poll /health of `names` until all answer 200; raise if one exits or the deadline passes."""
        pending = list(names)
        while pending:
            for name in list(pending):
                child = self.children[name]
                if not child.is_alive():
                    raise ClusterStartError(
                        f"{name} exited with code {child.popen.returncode} during startup; "
                        f"log {child.log_path}:\n{child.log_tail()}"
                    )
                if is_healthy(self.plans[name].health_url):
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {name} ({self.children[name].log_path}):\n{self.children[name].log_tail(15)}"
                                  for name in pending)
                raise ClusterStartError(f"not healthy within {self.config.startup_timeout_s:.0f} s: "
                                        f"{', '.join(pending)}\n{tails}")
            if pending:
                time.sleep(0.5)

    def dead(self) -> list[str]:
        """Names of started processes that have exited."""
        return [name for name, child in self.children.items() if not child.is_alive()]

    def kill(self, name: str) -> None:
        """SIGKILL one process and everything it started (a crash)."""
        kill_tree(self.children[name])

    def terminate(self, name: str, grace_s: float = 10.0) -> None:
        stop_tree(self.children[name], grace_s)

    def restart(self, name: str, timeout_s: float | None = None) -> NodeInfo:
        """Stop `name` if it still runs, start it again with the same command line, wait for /health."""
        if name in self.children and self.children[name].is_alive():
            stop_tree(self.children[name])
        self._spawn(self.plans[name])
        self.wait_healthy([name], time.monotonic() + (timeout_s or self.config.startup_timeout_s))
        return self.info(name)

    def stop(self, grace_s: float = 10.0, drain_s: float = NODE_DRAIN_WAIT_S) -> None:
        """Stop the router, then drain every node (at most `drain_s` each, in parallel); safe to call twice."""
        if "router" in self.children:
            self._stop_one("router", grace_s)
        nodes = [plan.name for plan in self.node_plans if plan.name in self.children]
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            list(pool.map(lambda name: self._drain_one(name, drain_s, grace_s), nodes))

    def _drain_one(self, name: str, drain_s: float, grace_s: float) -> None:
        drain_tree(self.children[name], drain_s, grace_s)

    def _stop_one(self, name: str, grace_s: float) -> None:
        child = self.children[name]
        # An exited child may have left descendants in its process group: stop the tree either way.
        stop_tree(child, grace_s if child.is_alive() else 0.5)
