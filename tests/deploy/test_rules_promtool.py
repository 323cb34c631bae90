"""`promtool test rules` over synthetic series: the shipped alerts fire for the pool that breaks its SLO,
after their `for:` delay, with the labels the summaries name, and stay quiet for healthy pools.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.prom_support import RULES_FILE

pytestmark = pytest.mark.process


def _histogram(name: str, labels: str, edges: dict[str, int]) -> list[dict]:
    """Cumulative bucket series growing by edges[le] per minute, plus _count."""
    series = [{"series": f'{name}_bucket{{{labels}, le="{le}"}}', "values": f"0+{step}x40"}
              for le, step in edges.items()]
    series.append({"series": f"{name}_count{{{labels}}}", "values": f"0+{edges['+Inf']}x40"})
    return series


TTFT = "pdcluster_time_to_first_token_seconds"
INPUT = (
    # pool tp: every request under 1 s; pool dcp: every request between 2 and 5 s.
    _histogram(TTFT, 'pool="tp", model="m"', {"1.0": 10, "2.0": 10, "5.0": 10, "+Inf": 10})
    + _histogram(TTFT, 'pool="dcp", model="m"', {"1.0": 0, "2.0": 0, "5.0": 10, "+Inf": 10})
    + [
        {"series": 'pdcluster_instance_healthy{instance="dcp-0", role="decode", pool="dcp"}', "values": "0x40"},
        {"series": 'pdcluster_instance_healthy{instance="tp-0", role="decode", pool="tp"}', "values": "1x40"},
        {"series": 'pdcluster_pair_compatible{prefill="p-0", decode="dcp-0"}', "values": "1x40"},
        {"series": 'pdcluster_pair_healthy{prefill="p-0", decode="dcp-0"}', "values": "0x40"},
        {"series": 'pdcluster_pair_compatible{prefill="p-0", decode="tp-0"}', "values": "1x40"},
        {"series": 'pdcluster_pair_healthy{prefill="p-0", decode="tp-0"}', "values": "1x40"},
        {"series": 'vllm:nixl_num_failed_transfers_total{pool="dcp", model_name="m"}', "values": "0+6x40"},
        {"series": 'vllm:nixl_num_failed_transfers_total{pool="tp", model_name="m"}', "values": "0x40"},
    ]
)


def _alert(name: str, eval_time: str, *expected: tuple[dict, dict]) -> dict:
    return {"eval_time": eval_time, "alertname": name,
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": notes} for labels, notes in expected]}


def test_alerts_fire_for_the_broken_pool_only(tmp_path) -> None:
    rules = yaml.safe_load(RULES_FILE.read_text())
    annotations = {r["alert"]: r["annotations"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    ttft_high = {"summary": "TTFT p99 of pool dcp is 4.97s (SLO 2 s)",
                 "description": annotations["PdclusterTTFTHigh"]["description"]}
    tests = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": INPUT,
            "alert_rule_test": [
                _alert("PdclusterTTFTHigh", "5m"),  # pending: `for: 10m`
                _alert("PdclusterTTFTHigh", "20m", ({"severity": "warning", "pool": "dcp"}, ttft_high)),
                _alert("PdclusterTTFTSLOBurn", "25m", ({"severity": "critical", "pool": "dcp"},
                       {"summary": "More than 5% of pool dcp requests miss the 2 s TTFT SLO"})),
                _alert("PdclusterInstanceUnhealthy", "5m", (
                    {"severity": "warning", "exported_instance": "dcp-0", "role": "decode", "pool": "dcp"},
                    {"summary": "decode instance dcp-0 of pool dcp is unhealthy"})),
                _alert("PdclusterPairBroken", "10m", ({"severity": "warning", "prefill": "p-0", "decode": "dcp-0"},
                       {"summary": "Compatible pair p-0 -> dcp-0 is broken (breaker open)"})),
                _alert("PdclusterKVTransferFailures", "10m", ({"severity": "critical", "pool": "dcp"},
                       {"summary": "NIXL KV reads fail in pool dcp (0.1/s)"})),
            ],
        }],
    }
    # The unit-test series use the names Prometheus stores: the router's `instance` label is
    # renamed by the scrape (target label `instance` wins), so feed it as `exported_instance`.
    text = yaml.safe_dump(tests).replace('instance="', 'exported_instance="')
    path = tmp_path / "rules_test.yaml"
    path.write_text(text)
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
