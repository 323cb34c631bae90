"""Structural checks for the custom resources kubernetes-validate has no schema for.

Each check names the fields the controller reads (LeaderWorkerSet v1 types, prometheus-operator v1
ServiceMonitor/PodMonitor/PrometheusRule, NVIDIA DRA ComputeDomain v1beta1) and fails on unknown keys at
the levels the chart writes, so a typo in a CRD field cannot pass silently. Pod templates inside a
LeaderWorkerSet are validated as core Pods by the caller.
"""

from __future__ import annotations

import re

DURATION = re.compile(r"^([0-9]+(ms|s|m|h))+$")


def _keys_within(obj: dict, allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown fields {sorted(unknown)} (allowed {sorted(allowed)})"


def check_leaderworkerset(doc: dict) -> None:
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1", doc["apiVersion"]
    spec = doc["spec"]
    _keys_within(spec, {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"},
                 "LeaderWorkerSet.spec")
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 0
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    rollout = spec.get("rolloutStrategy", {})
    _keys_within(rollout, {"type", "rollingUpdateConfiguration"}, "LeaderWorkerSet.spec.rolloutStrategy")
    assert rollout.get("type", "RollingUpdate") == "RollingUpdate"
    _keys_within(rollout.get("rollingUpdateConfiguration", {}), {"partition", "maxUnavailable", "maxSurge"},
                 "rollingUpdateConfiguration")
    lwt = spec["leaderWorkerTemplate"]
    _keys_within(lwt, {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                       "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}, "leaderWorkerTemplate")
    assert isinstance(lwt["size"], int) and lwt["size"] >= 1
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in (
        "Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None")
    for part in ("leaderTemplate", "workerTemplate"):
        _keys_within(lwt[part], {"metadata", "spec"}, f"leaderWorkerTemplate.{part}")
        assert lwt[part]["spec"]["containers"], f"{part} has no containers"


def _check_endpoint(endpoint: dict, where: str) -> None:
    _keys_within(endpoint, {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                            "metricRelabelings", "honorLabels"}, where)
    assert isinstance(endpoint["port"], str), f"{where}: port must be a port name"
    assert endpoint.get("path", "/metrics").startswith("/")
    assert DURATION.match(endpoint.get("interval", "30s")), f"{where}: bad interval {endpoint.get('interval')}"
    for relabel in endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []):
        _keys_within(relabel, {"sourceLabels", "targetLabel", "regex", "replacement", "action", "separator"},
                     f"{where}.relabelings")
        if relabel.get("action", "replace") in ("keep", "drop"):  # filters name no target label
            assert relabel.get("sourceLabels") and "targetLabel" not in relabel, relabel
            continue
        assert re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", relabel["targetLabel"]), relabel


def check_service_monitor(doc: dict, services: list[dict]) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    _keys_within(spec, {"selector", "namespaceSelector", "endpoints", "jobLabel"}, "ServiceMonitor.spec")
    selector = spec["selector"]["matchLabels"]
    matched = [svc for svc in services if selector.items() <= svc["metadata"]["labels"].items()]
    assert len(matched) == 1, f"ServiceMonitor selects {len(matched)} Services"
    port_names = {port["name"] for port in matched[0]["spec"]["ports"]}
    for i, endpoint in enumerate(spec["endpoints"]):
        _check_endpoint(endpoint, f"ServiceMonitor.endpoints[{i}]")
        assert endpoint["port"] in port_names, f"endpoint port {endpoint['port']} not in {port_names}"


def check_pod_monitor(doc: dict, serving_pods: list) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    _keys_within(spec, {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel"}, "PodMonitor.spec")
    selector = spec["selector"]["matchLabels"]
    selected = [pod for pod in serving_pods if selector.items() <= pod.labels.items()]
    assert selected, "PodMonitor selects no serving pod template"
    # Prometheus Operator scrapes an endpoint on the pods that have a port of its name (others yield no target):
    # every selected pod must be scraped by some endpoint, and every endpoint must match some pod.
    endpoints = spec["podMetricsEndpoints"]
    for i, endpoint in enumerate(endpoints):
        _check_endpoint(endpoint, f"PodMonitor.podMetricsEndpoints[{i}]")
    for pod in selected:
        names = {port["name"] for port in pod.container.get("ports", [])}
        assert any(e["port"] in names for e in endpoints), f"{pod.owner_name}: no port of {[e['port'] for e in endpoints]}"


def check_prometheus_rule(doc: dict) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    _keys_within(doc["spec"], {"groups"}, "PrometheusRule.spec")
    for group in doc["spec"]["groups"]:
        _keys_within(group, {"name", "interval", "rules", "limit", "partial_response_strategy"}, "rule group")
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            _keys_within(rule, {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"},
                         f"rule {rule.get('alert') or rule.get('record')}")


def check_compute_domain(doc: dict, pods: list) -> None:
    assert doc["apiVersion"] == "resource.nvidia.com/v1beta1"
    spec = doc["spec"]
    _keys_within(spec, {"numNodes", "channel"}, "ComputeDomain.spec")
    assert spec.get("numNodes", 0) == 0, "numNodes is deprecated: 0 lets the driver follow the pods"
    claim = spec["channel"]["resourceClaimTemplate"]["name"]
    for pod in pods:
        templates = {c.get("resourceClaimTemplateName") for c in pod.spec.get("resourceClaims", [])}
        assert claim in templates, f"{pod.owner_name}/{pod.part} does not join the ComputeDomain channel {claim}"
