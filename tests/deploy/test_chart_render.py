"""helm lint and helm template over every example values file; every rendered object validated offline.

Core kinds go through kubernetes-validate (strict, Kubernetes 1.35 schemas); LeaderWorkerSet pod templates
are validated as core Pods; the CRD objects (LeaderWorkerSet, ServiceMonitor, PodMonitor, PrometheusRule,
ComputeDomain) get structural checks (tests/deploy/crd_checks.py).
"""

from __future__ import annotations

import json
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy import crd_checks
from tests.deploy.helm_support import CHART, EXAMPLE_VALUES, KUBE_VERSION, Rendered, render, run_helm

pytestmark = pytest.mark.process

CRD_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ComputeDomain"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {name: render(name) for name in EXAMPLE_VALUES}


def test_helm_is_v4_1_4() -> None:
    assert run_helm("version", "--short").stdout.startswith("v4.1.4")


@pytest.mark.parametrize("values", EXAMPLE_VALUES)
def test_helm_lint_strict(values: str) -> None:
    proc = run_helm("lint", str(CHART), "--strict", "-f", str(CHART / values), "--kube-version", KUBE_VERSION)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("values", EXAMPLE_VALUES)
def test_rendered_objects_validate(values: str, rendered: dict[str, Rendered]) -> None:
    out = rendered[values]
    core, custom = [], []
    for doc in out.docs:
        (custom if doc["kind"] in CRD_KINDS else core).append(doc)
    for doc in core:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    for pod in out.pod_templates():
        pod_doc = {"apiVersion": "v1", "kind": "Pod", "metadata": pod.metadata, "spec": pod.spec}
        try:
            kubernetes_validate.validate(pod_doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{pod.owner_kind}/{pod.owner_name} {pod.part} pod: {exc.message} at {list(exc.path)}")
    services = out.of_kind("Service")
    serving = [pod for pod in out.pod_templates() if pod.labels.get("pdcluster.io/serving") == "true"]
    node_pods = [pod for pod in out.pod_templates() if pod.labels.get("app.kubernetes.io/component") == "node"]
    for doc in custom:
        {
            "LeaderWorkerSet": lambda d: crd_checks.check_leaderworkerset(d),
            "ServiceMonitor": lambda d: crd_checks.check_service_monitor(d, services),
            "PodMonitor": lambda d: crd_checks.check_pod_monitor(d, serving),
            "PrometheusRule": lambda d: crd_checks.check_prometheus_rule(d),
            "ComputeDomain": lambda d: crd_checks.check_compute_domain(d, node_pods),
        }[doc["kind"]](doc)
    assert core and out.of_kind("Deployment"), "no core objects rendered"


def test_gb300_renders_every_crd_kind(rendered: dict[str, Rendered]) -> None:
    kinds = {doc["kind"] for doc in rendered["values-gb300-tp8-dcp8.yaml"].docs}
    assert CRD_KINDS <= kinds, f"missing {CRD_KINDS - kinds}"
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "Role", "RoleBinding"} <= kinds


def test_dra_gpu_claims_render_resource_claim_templates(tmp_path) -> None:
    out = render("values-gb300-tp8-dcp8.yaml", overrides={"dra": {"gpus": True}}, tmp_dir=tmp_path)
    templates = out.of_kind("ResourceClaimTemplate")
    assert len(templates) == 3
    for doc in templates:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        request = doc["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        assert request == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 4}
    node_pods = [pod for pod in out.pod_templates() if pod.labels["app.kubernetes.io/component"] == "node"]
    assert len(node_pods) == 6  # 3 pools x (leader, worker)
    for pod in node_pods:
        assert "nvidia.com/gpu" not in pod.container["resources"].get("limits", {})
        claims = {claim["name"] for claim in pod.container["resources"]["claims"]}
        assert claims == {"gpus", "nvlink-channel"}


@pytest.mark.parametrize("values", ["values.yaml", "values-gb300-tp8-dcp8.yaml"])
def test_prometheus_rule_is_the_rules_file_and_promtool_accepts_it(values: str, rendered: dict[str, Rendered],
                                                                    tmp_path) -> None:
    (rule,) = rendered[values].of_kind("PrometheusRule")
    shipped = yaml.safe_load((CHART / "rules" / "pdcluster-rules.yaml").read_text())
    assert rule["spec"]["groups"] == shipped["groups"]
    extracted = tmp_path / "rendered-rules.yaml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run(["promtool", "check", "rules", str(extracted)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboards_ship_as_sidecar_configmaps(rendered: dict[str, Rendered]) -> None:
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(files) >= 2
    for values in EXAMPLE_VALUES:
        maps = [cm for cm in rendered[values].of_kind("ConfigMap") if "grafana_dashboard" in cm["metadata"]["labels"]]
        assert len(maps) == len(files), values
        for cm in maps:
            assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
            ((key, text),) = cm["data"].items()
            assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())
