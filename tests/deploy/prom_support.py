"""A real Prometheus (Debian package) on a free port, scraping given targets with the chart's rules loaded,
and the PromQL the chart ships: every dashboard panel target and every rule expression.

Scrape targets come from the caller (a stand-in or a real cluster), each with the target labels the
chart's PodMonitor/ServiceMonitor would attach (`pool`, `role`, `tp`, `dcp`, `engine_kind`, `pod`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.conftest import free_port

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdcluster"
RULES_FILE = CHART / "rules" / "pdcluster-rules.yaml"
RATE_WINDOW = "1m"
"""What `$__rate_interval` becomes: wide enough for several 1 s scrapes."""
COMPARISON = re.compile(r"^(?P<query>.*?)\s*(?:>=|<=|==|!=|>|<)\s*-?[0-9.]+(?:e[+-]?[0-9]+)?\s*$", re.S)


@dataclass(frozen=True)
class ScrapeTarget:
    url: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChartQuery:
    """One PromQL expression the chart ships, with where it comes from."""

    source: str  # "dashboard <file> / <panel title> / <refId>" or "rule <name>"
    expr: str
    kind: str  # panel | alert | record

    @property
    def metric_names(self) -> set[str]:
        return metric_names(self.expr)


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (identifiers followed by `{`, `[` or standing alone as a selector)."""
    stripped = re.sub(r'"[^"]*"', '""', expr)
    candidates = set(re.findall(r"(?<![\w:.])([a-zA-Z_:][\w:]*)\s*(?=\{|\[)", stripped))
    candidates |= set(re.findall(r"\(\s*([a-zA-Z_:][\w:]*)\s*\)", stripped))
    keywords = {"sum", "max", "min", "avg", "count", "rate", "increase", "by", "on", "without", "histogram_quantile"}
    return {name for name in candidates if name not in keywords and ("_" in name or ":" in name)}


def grafana_to_promql(expr: str) -> str:
    """Substitute the dashboard's template variables the way Grafana would with `All` selected."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$pool", ".*")


def dashboard_queries() -> list[ChartQuery]:
    queries = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries.append(ChartQuery(f"dashboard {path.name} / {panel['title']} / {target['refId']}",
                                          target["expr"], "panel"))
    return queries


def rule_queries() -> list[ChartQuery]:
    queries = []
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            kind = "alert" if "alert" in rule else "record"
            queries.append(ChartQuery(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"], kind))
    return queries


def alert_query_part(expr: str) -> str:
    """The query left of an alert's final `<op> <number>` (what must return data on a healthy system)."""
    match = COMPARISON.match(expr.strip())
    assert match, f"alert expression does not end in a comparison with a number: {expr}"
    return match.group("query")


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus not found: run scripts/setup/prometheus.sh (apt-get install prometheus)")
    return found


class PrometheusServer:
    """`prometheus` with a temp config: 2 s scrapes, 1 s rule evaluation, the chart's rules file loaded."""

    def __init__(self, targets: list[ScrapeTarget], work_dir: Path, rule_files: list[Path] | None = None,
                 node_metric_relabels: list[dict] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.work_dir = work_dir
        jobs: dict[tuple, list[ScrapeTarget]] = {}
        for target in targets:
            parsed = urlparse(target.url)
            is_node = target.labels.get("job") == "pdcluster-nodes"
            jobs.setdefault((parsed.scheme, parsed.path or "/metrics", is_node), []).append(target)
        scrape_configs = []
        for index, ((scheme, path, is_node), group) in enumerate(jobs.items()):
            job = {"job_name": f"targets-{index}", "scheme": scheme, "metrics_path": path,
                   "static_configs": [{"targets": [urlparse(t.url).netloc], "labels": t.labels} for t in group]}
            if is_node and node_metric_relabels:
                job["metric_relabel_configs"] = node_metric_relabels
            scrape_configs.append(job)
        config = {"global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in (rule_files if rule_files is not None else [RULES_FILE])],
                  "scrape_configs": scrape_configs}
        self.config_path = work_dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = work_dir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> "PrometheusServer":
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.work_dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def api(self, path: str, **params: str) -> dict:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query, at `at` (unix seconds) or now."""
        data = self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        assert data["resultType"] == "vector", f"{expr}: result type {data['resultType']}"
        return data["result"]

    def wait_targets_up(self, expected: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.api("targets")["activeTargets"]
            up = [t for t in active if t["health"] == "up"]
            if len(up) == expected:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(up)}/{expected} targets up: "
                                     f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in active]}")
            time.sleep(0.5)

    def wait_scrapes(self, count: int, timeout_s: float = 60.0) -> None:
        """Until every target has been scraped at least `count` times within the rate window."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(f"min(count_over_time(up[{RATE_WINDOW}]))")
            if result and float(result[0]["value"][1]) >= count:
                return
            assert time.monotonic() < deadline, f"fewer than {count} scrapes per target within {timeout_s} s"
            time.sleep(0.5)

    def all_up_instant(self, expected: int, before: float | None = None, lookback_s: float = 60.0) -> float:
        """The latest instant (at or before `before`, default now) at which every target's last scrape
        succeeded: a failed scrape (a slow, loaded machine) marks that target's series stale, and an instant
        query would then miss them."""
        end = time.time() if before is None else before
        t = end
        while t > end - lookback_s:
            result = self.query("sum(up)", at=t)
            if result and float(result[0]["value"][1]) == expected:
                return t
            t -= 0.5
        raise AssertionError(f"no instant in the last {lookback_s} s with all {expected} targets up")

    def wait_rules_evaluated(self, timeout_s: float = 30.0) -> list[dict]:
        """Until every loaded rule has been evaluated at least once; returns the rules."""
        deadline = time.monotonic() + timeout_s
        while True:
            rules = [rule for group in self.api("rules")["groups"] for rule in group["rules"]]
            if rules and all(not rule["lastEvaluation"].startswith("0001") for rule in rules):
                return rules
            assert time.monotonic() < deadline, "rules not all evaluated"
            time.sleep(0.5)


def finite_values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result if math.isfinite(float(sample["value"][1]))]


def chart_node_metric_relabels() -> list[dict]:
    """The PodMonitor's metricRelabelings, as Prometheus `metric_relabel_configs` (what the operator generates)."""
    from tests.deploy.helm_support import render  # noqa: PLC0415 - helm only where a test asks for it

    (monitor,) = render("values.yaml").of_kind("PodMonitor")
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
            "replacement": "replacement", "action": "action", "separator": "separator"}
    relabels = []
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        for rule in endpoint.get("metricRelabelings", []):
            relabels.append({keys[key]: value for key, value in rule.items()})
    return relabels


def running_prometheus(targets: list[ScrapeTarget], work_dir: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(targets, work_dir, node_metric_relabels=chart_node_metric_relabels())
    try:
        yield server.start()
    finally:
        server.stop()


def _check_one(prom: PrometheusServer, query: ChartQuery, at: float | None) -> str | None:
    """None when the query is fine, else what is wrong with it."""
    expr = grafana_to_promql(query.expr) if query.kind == "panel" else query.expr
    try:
        prom.query(expr, at)
        probe = alert_query_part(expr) if query.kind == "alert" else expr
        if not finite_values(prom.query(probe, at)):
            return f"{query.source}: no finite sample from {probe}"
    except AssertionError as exc:
        return f"{query.source}: {exc}"
    return None


def check_chart_queries(prom: PrometheusServer, exclude: set[str] | None = None, at: float | None = None) -> list[str]:
    """Evaluate every dashboard panel target and every rule through the HTTP API; return the failures.

    Panels and recording rules must return at least one finite sample; alert rules must evaluate, and the
    query left of their threshold must return finite data. Every loaded rule must report health `ok`.
    `exclude` names metrics a cluster cannot have (e.g. reference-only series on a vLLM cluster): queries
    that use only excluded metrics are skipped. `at` evaluates every query at one instant (e.g. just after
    a load run ended, so rate windows still cover it), else now.
    """
    exclude = exclude or set()
    queries = [q for q in dashboard_queries() + rule_queries() if not (q.metric_names and q.metric_names <= exclude)]
    failures = [f"rule {rule['name']}: health {rule['health']} {rule.get('lastError', '')}"
                for rule in prom.wait_rules_evaluated() if rule["health"] != "ok"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        failures += [failure for failure in pool.map(lambda q: _check_one(prom, q, at), queries) if failure]
    return failures
