"""Static checks of what the chart ships for Prometheus and Grafana: promtool accepts the rules, every series
a dashboard or rule reads is in the docs/METRICS.md contract (by exposition name), SLO thresholds sit on
bucket edges the router really has, and the dashboards are well-formed Grafana JSON.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from router.metrics import TTFT_BUCKETS
from tests.deploy.metrics_contract import exposed_index, load_contract
from tests.deploy.prom_support import (CHART, RULES_FILE, alert_query_part, dashboard_queries, metric_names,
                                       rule_queries)


@pytest.mark.process
def test_promtool_check_rules() -> None:
    proc = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rule_queries())} rules found" in proc.stdout


@pytest.mark.process
def test_promtool_rejects_a_broken_rule(tmp_path) -> None:
    """The check above can fail: a typo in PromQL is caught."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "histogram_quantile(0.99, sum by (le (rate(x[5m])))"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(rules))
    proc = subprocess.run(["promtool", "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def test_every_queried_series_is_in_the_metric_contract() -> None:
    index = exposed_index(load_contract())
    recorded = {q.source.removeprefix("rule ") for q in rule_queries() if q.kind == "record"}
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 60
    unknown = {}
    for query in queries:
        names = metric_names(query.expr)
        assert names, f"{query.source}: no series found in {query.expr}"
        for name in names - recorded:
            if name not in index:
                unknown.setdefault(name, []).append(query.source)
    assert not unknown, f"series not in docs/METRICS.md (as exposed): {unknown}"


def test_dashboards_cover_the_contract() -> None:
    """Every metric of the contract shows up in some dashboard panel (except static cache info)."""
    used = set().union(*(q.metric_names for q in dashboard_queries()))
    missing = [spec.name for spec in load_contract() if not set(spec.exposed_names) & used]
    assert not missing, f"contract metrics no dashboard shows: {missing}"


def test_alerts_are_thresholds_with_severity_and_summary() -> None:
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                assert re.fullmatch(r"[a-z_]+:[a-z_:0-9]+:[a-z0-9_]+", rule["record"]), rule["record"]
                continue
            alert_query_part(rule["expr"])
            assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_ttft_slo_reads_a_real_router_bucket_edge() -> None:
    text = RULES_FILE.read_text()
    edges = set(re.findall(r'pdcluster_time_to_first_token_seconds_bucket\{le="([0-9.]+)"\}', text))
    assert edges == {"2.0"}
    assert 2.0 in TTFT_BUCKETS


@pytest.mark.parametrize("path", sorted((CHART / "dashboards").glob("*.json")), ids=lambda p: p.name)
def test_dashboard_json_is_grafana_shaped(path) -> None:
    board = json.loads(path.read_text())
    assert board["uid"] == path.stem and board["title"].startswith("pdcluster")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["pool"]["includeAll"] and variables["pool"]["allValue"] == ".*"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"].strip()
            assert "[5m]" not in target["expr"], "panels use $__rate_interval"


def test_router_dashboard_has_the_slo_views() -> None:
    titles = {p["title"] for p in json.loads((CHART / "dashboards" / "pdcluster-router.json").read_text())["panels"]}
    assert {"TTFT", "TPOT", "ITL", "E2E latency", "Leg p99", "TTFT SLO attainment (<= 2 s)"} <= titles
    pools = {p["title"] for p in json.loads((CHART / "dashboards" / "pdcluster-pools.json").read_text())["panels"]}
    assert {"KV cache usage", "Transfer bandwidth", "Transfer failures and expired leases",
            "DCP merge fallbacks", "Running requests"} <= pools
