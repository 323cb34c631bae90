"""A real Prometheus scrapes live /metrics (the stand-in fixture `scrape_targets`, see conftest.py) with the
chart's rules loaded; every dashboard panel and every rule is evaluated through the HTTP API.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.prom_support import (PrometheusServer, ScrapeTarget, alert_query_part, check_chart_queries,
                                       finite_values, rule_queries, running_prometheus)

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def prometheus(scrape_targets: list[ScrapeTarget], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    for server in running_prometheus(scrape_targets, tmp_path_factory.mktemp("prometheus")):
        server.wait_targets_up(len(scrape_targets))
        server.wait_scrapes(4)
        yield server


def test_every_panel_and_rule_returns_data(prometheus: PrometheusServer, scrape_targets: list[ScrapeTarget]) -> None:
    failures = check_chart_queries(prometheus, at=prometheus.all_up_instant(len(scrape_targets)))
    assert not failures, "\n".join(failures)


def test_ttft_alert_fires_only_for_the_slow_pool(prometheus: PrometheusServer,
                                                 scrape_targets: list[ScrapeTarget]) -> None:
    (ttft,) = [q for q in rule_queries() if q.source == "rule PdclusterTTFTHigh"]
    at = prometheus.all_up_instant(len(scrape_targets))
    firing = prometheus.query(ttft.expr, at)
    assert {sample["metric"]["pool"] for sample in firing} == {"dcp"}, firing
    by_pool = {s["metric"]["pool"]: float(s["value"][1]) for s in prometheus.query(alert_query_part(ttft.expr), at)}
    assert by_pool["tp"] < 2.0 < by_pool["dcp"]


def test_unhealthy_instance_alert_names_it(prometheus: PrometheusServer, scrape_targets: list[ScrapeTarget]) -> None:
    (rule,) = [q for q in rule_queries() if q.source == "rule PdclusterInstanceUnhealthy"]
    firing = prometheus.query(rule.expr, prometheus.all_up_instant(len(scrape_targets)))
    assert [s["metric"]["exported_instance"] for s in firing] == ["dcp-0"]


def test_node_series_carry_pool_labels(prometheus: PrometheusServer, scrape_targets: list[ScrapeTarget]) -> None:
    at = prometheus.all_up_instant(len(scrape_targets))
    pools = {s["metric"].get("pool") for s in prometheus.query("sum by (pool) (vllm:num_requests_running)", at)}
    assert pools == {"prefill", "tp", "dcp"}
    assert finite_values(prometheus.query('vllm:kv_cache_usage_perc{pool="dcp", engine_kind="reference"}', at))
