"""Chart hardening, rendered by real helm and validated by kubernetes-validate: pool pods' CPU/memory requests
and limits, restricted security contexts (non-root where no RDMA capability is needed), the router's
read-only root filesystem, grace periods consistent with the node drain time and a preStop hook, egress
NetworkPolicies, the safe `routerFrom` default, the headless Service that carries drain broadcasts, and
the router's admission cap."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from router.config import RouterConfig
from tests.deploy.helm_support import KUBE_VERSION, RELEASE, Rendered, render, render_error

pytestmark = pytest.mark.process
CPU_DEV = "values-cpu-dev.yaml"
ROUTER = f"{RELEASE}-pdcluster-router"


def validate_all(out: Rendered) -> None:
    for doc in out.docs:
        if doc["kind"] in ("Deployment", "Service", "NetworkPolicy", "ConfigMap"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def pool_pods(out: Rendered):
    return [pod for pod in out.pod_templates() if pod.labels.get("app.kubernetes.io/component") == "node"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("values,rdma", [("values.yaml", True), (CPU_DEV, False)], ids=["gpu-rdma", "cpu-dev"])
def test_pool_pods_have_resources_and_a_restricted_context(values, rdma):
    out = render(values)
    validate_all(out)
    pods = pool_pods(out)
    assert pods
    for pod in pods:
        res = pod.container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[kind]), (pod.owner_name, kind, res)
        assert pod.spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        ctx = pod.container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
        if rdma:
            assert ctx["capabilities"]["add"] == ["IPC_LOCK"]
        else:
            assert "add" not in ctx["capabilities"]
        assert pod.spec["securityContext"]["runAsNonRoot"] is True, "never root, RDMA included"
        assert pod.spec["securityContext"]["runAsUser"] != 0


def test_router_runs_read_only_non_root_with_a_tmp_volume():
    out = render("values.yaml")
    spec = out.named("Deployment", ROUTER)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "worker processes keep their shared state under /tmp"
    assert spec["terminationGracePeriodSeconds"] > 30, "the router's own graceful stop is 30 s"


@pytest.mark.parametrize("grace", [60, 120])
def test_node_drain_fits_the_grace_period(tmp_path, grace):
    overrides = {"poolDefaults": {"terminationGracePeriodSeconds": grace}} if grace != 60 else None
    out = render(CPU_DEV, overrides=overrides, tmp_dir=tmp_path)
    validate_all(out)
    for pod in pool_pods(out):
        assert pod.spec["terminationGracePeriodSeconds"] == grace
        assert pod.container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        role = pod.labels["pdcluster.io/role"].upper()
        assert env_of(pod.container)[f"{role}_DRAIN_S"] == str(grace - 5)


def test_drain_longer_than_the_grace_period_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pools": [
        {"name": "prefill", "role": "prefill", "engine": "reference"},
        {"name": "tp", "role": "decode", "engine": "reference", "settings": {"drain_s": 59}}]}))
    assert "leaves no time" in render_error(bad)
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({"poolDefaults": {"terminationGracePeriodSeconds": 5}}))
    assert "terminationGracePeriodSeconds" in render_error(short)


def test_network_policies_default_to_namespace_ingress_and_limited_egress():
    out = render("values.yaml")
    policies = {p["metadata"]["name"]: p["spec"] for p in out.of_kind("NetworkPolicy")}
    router = policies[f"{RELEASE}-pdcluster-router"]
    assert router["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = router["ingress"]
    assert {"podSelector": {}} in ingress["from"], "safe default: the release's namespace only"
    peers = [p for p in ingress["from"] if p.get("podSelector", {}).get("matchLabels", {}).get(
        "app.kubernetes.io/component") == "router"]
    assert peers, "router replicas reach each other (drain broadcast)"
    egress_ports = [sorted(str(p["port"]) for p in rule.get("ports", [])) for rule in router["egress"]]
    assert ["http"] in egress_ports and ["53", "53"] in egress_ports and ["443", "6443"] in egress_ports
    targets = [t["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for t in router["egress"][0]["to"]]
    assert targets == ["node", "router"]
    nodes = policies[f"{RELEASE}-pdcluster-nodes"]
    assert nodes["policyTypes"] == ["Ingress", "Egress"]
    assert nodes["egress"][0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "node"
    assert len(nodes["egress"]) == 2, "nodes reach each other and DNS only, unless nodeEgress adds rules"


def test_egress_policies_can_be_turned_off_and_router_opened(tmp_path):
    out = render("values.yaml", overrides={"networkPolicy": {"egress": False, "routerFrom": []}}, tmp_dir=tmp_path)
    validate_all(out)
    for policy in out.of_kind("NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    router = next(p for p in out.of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-router"))
    assert "from" not in router["spec"]["ingress"][0], "an empty routerFrom opens the port to anyone"


def test_headless_peers_service_carries_drain_broadcasts():
    out = render("values.yaml")
    peers = out.named("Service", f"{ROUTER}-peers")["spec"]
    assert peers["clusterIP"] == "None"
    template = out.named("Deployment", ROUTER)["spec"]["template"]
    assert peers["selector"].items() <= template["metadata"]["labels"].items()
    env = env_of(template["spec"]["containers"][0])
    host, port = env["ROUTER_PEER_DNS"].rsplit(":", 1)
    assert host.startswith(f"{ROUTER}-peers.") and port == str(peers["ports"][0]["port"])


def test_router_config_carries_the_admission_cap(tmp_path):
    out = render("values.yaml", overrides={"router": {"maxInflightPerPool": 64}}, tmp_dir=tmp_path)
    config = RouterConfig.model_validate(yaml.safe_load(out.named("ConfigMap", ROUTER)["data"]["router.yaml"]))
    assert config.router["max_inflight_per_pool"] == 64
    out = render("values.yaml", overrides={"router": {"settings": {"max_inflight_per_pool": 8}}}, tmp_dir=tmp_path)
    config = yaml.safe_load(out.named("ConfigMap", ROUTER)["data"]["router.yaml"])
    assert config["router"]["max_inflight_per_pool"] == 8, "the router's own settings win"
