"""The chart's secrets and node network surface (issue #34), rendered by real helm and validated by
kubernetes-validate: the cluster secret, the admin token and the client API keys reach their processes as
read-only mounted files, never as environment variables or flags; LWS worker pods get no secret; every pod
carries a checksum of the cluster secret, so rotating it restarts them; pods never run as root; nodes open to
each other only their HTTP port, vLLM's side-channel port and the UCX port range."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.helm_support import KUBE_VERSION, RELEASE, Rendered, render

pytestmark = pytest.mark.process
ROUTER = f"{RELEASE}-pdcluster-router"
GB300 = "values-gb300-tp8-dcp8.yaml"
SECRET_DIR = "/var/run/pdcluster/cluster-secret"


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _validate(out: Rendered) -> None:
    for doc in out.docs:
        if doc["kind"] in ("Deployment", "NetworkPolicy", "Secret"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _mounted_secret(pod_spec: dict, container: dict, path: str) -> dict:
    """The Secret volume that `path` lies in (asserting it is mounted read-only and not world-readable)."""
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True, (path, container.get("volumeMounts"))
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mounts[0]["name"])
    assert "secret" in volume and volume["secret"]["defaultMode"] & 0o007 == 0, volume
    return volume["secret"]


def _no_secret_in_env_or_args(container: dict) -> None:
    for name, entry in _env(container).items():
        assert "secretKeyRef" not in entry.get("valueFrom", {}), f"{name} comes from a Secret as an env var"
    assert not {"--admin-token", "--cluster-secret", "--api-keys"} & set(map(str, container.get("args", [])))


@pytest.mark.parametrize("values", ["values.yaml", GB300])
def test_cluster_secret_is_a_mounted_file_on_serving_pods_only(values):
    out = render(values)
    _validate(out)
    serving = 0
    for pod in out.pod_templates():
        container = pod.container
        _no_secret_in_env_or_args(container)
        env = _env(container)
        files = [n for n in env if n.endswith("_CLUSTER_SECRET_FILE")]
        is_reference = pod.labels.get("pdcluster.io/engine") != "vllm" and pod.labels.get(
            "app.kubernetes.io/component") == "node"
        if pod.part == "worker" or not (is_reference or pod.owner_name == ROUTER):
            assert not files and not any(v["name"] == "cluster-secret" for v in pod.spec.get("volumes", [])), (
                pod.owner_name, pod.part, "a pod that serves no control route holds no secret")
            continue
        (name,) = files
        assert env[name]["value"].startswith(SECRET_DIR + "/")
        secret = _mounted_secret(pod.spec, container, env[name]["value"])
        assert secret["secretName"] == f"{RELEASE}-pdcluster-cluster-secret"
        assert pod.spec["securityContext"].get("fsGroup"), "the non-root user reads the 0440 file through fsGroup"
        serving += 1
    assert serving >= (3 if values == "values.yaml" else 1)  # router + reference pools (GB300: vLLM pools)


def test_router_gets_admin_token_and_api_keys_as_files(tmp_path):
    out = render("values.yaml", overrides={"router": {"adminTokenSecret": "ops-admin", "apiKeysSecret": "client-keys"}},
                 tmp_dir=tmp_path)
    _validate(out)
    spec = out.named("Deployment", ROUTER)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    _no_secret_in_env_or_args(container)
    env = _env(container)
    assert _mounted_secret(spec, container, env["ROUTER_ADMIN_TOKEN_FILE"]["value"])["secretName"] == "ops-admin"
    assert _mounted_secret(spec, container, env["ROUTER_API_KEYS_FILE"]["value"])["secretName"] == "client-keys"
    assert _mounted_secret(spec, container, env["ROUTER_CLUSTER_SECRET_FILE"]["value"])
    assert "ROUTER_ADMIN_TOKEN" not in env and "ROUTER_API_KEYS" not in env


def _checksums(out: Rendered) -> set[str]:
    """The checksum annotation of every pod template that mounts the cluster secret (asserting each has one)."""
    found = set()
    for pod in out.pod_templates():
        if any(v["name"] == "cluster-secret" for v in pod.spec.get("volumes", [])):
            found.add(pod.metadata.get("annotations", {}).get("checksum/cluster-secret"))
    assert None not in found, "a pod holding the secret would not restart when it rotates"
    return found


def test_a_rotated_cluster_secret_restarts_every_pod(tmp_path):
    """Every pod template holding the secret (router, reference pools) carries one checksum of it; a new revision
    of an operator's Secret changes it, so the workloads roll."""
    base = {"clusterSecret": {"existingSecret": "ops-cluster-secret", "revision": "1"}}
    first = render("values.yaml", overrides=base, tmp_dir=tmp_path)
    (before,) = _checksums(first)
    assert before
    (after,) = _checksums(render("values.yaml", overrides={"clusterSecret": {**base["clusterSecret"],
                                                                            "revision": "2"}}, tmp_dir=tmp_path))
    assert after != before
    assert not first.of_kind("Secret") or all(
        s["metadata"]["name"] != f"{RELEASE}-pdcluster-cluster-secret" for s in first.of_kind("Secret"))


def test_a_created_secret_and_the_checksum_agree():
    """One render draws one key: the Secret it creates is the one the pods' checksum covers."""
    import hashlib

    out = render("values.yaml")
    secret = out.named("Secret", f"{RELEASE}-pdcluster-cluster-secret")["data"]["cluster-secret"]
    (checksum,) = _checksums(out)
    assert checksum == hashlib.sha256(f"{secret}/".encode()).hexdigest()


@pytest.mark.parametrize("rdma", [True, False], ids=["rdma", "no-rdma"])
def test_pool_pods_never_run_as_root(tmp_path, rdma):
    out = render(GB300, overrides={"rdma": {"enabled": rdma}}, tmp_dir=tmp_path)
    for pod in out.pod_templates():
        ctx = pod.spec.get("securityContext", {})
        assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser", 0) != 0, (pod.owner_name, pod.part)
        caps = pod.container.get("securityContext", {}).get("capabilities", {})
        assert caps.get("drop") == ["ALL"] and caps.get("add", []) == (["IPC_LOCK"] if rdma and pod.labels.get(
            "app.kubernetes.io/component") == "node" else [])


def _node_rules(out: Rendered) -> tuple[list[dict], list[dict]]:
    spec = out.named("NetworkPolicy", f"{RELEASE}-pdcluster-nodes")["spec"]
    return spec["ingress"], spec["egress"]


def test_nodes_reach_each_other_on_their_ports_only():
    out = render(GB300)
    _validate(out)
    ingress, egress = _node_rules(out)
    for rules in (ingress, egress):
        for rule in rules:
            assert rule.get("ports"), f"a rule without ports opens every port: {rule}"
    node_to_node = [r for r in ingress if any(
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "node"
        for p in r["from"])]
    (rule,) = node_to_node
    ports = {(str(p["port"]), p.get("endPort")) for p in rule["ports"]}
    assert ports == {("http", None), ("5600", None), ("20000", 20999)}
    pool_env = {e["name"]: e.get("value") for pod in out.pod_templates() for e in pod.container.get("env", [])}
    assert pool_env["UCX_TCP_PORT_RANGE"] == "20000-20999"
    instance = [p for p in out.of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-instance")]
    assert instance, "multi-node pools get a policy of their own"
    for policy in instance:
        pool = policy["spec"]["podSelector"]["matchLabels"]["pdcluster.io/pool"]
        (peer,) = policy["spec"]["ingress"][0]["from"]
        assert peer["podSelector"]["matchLabels"]["pdcluster.io/pool"] == pool, "every port, within one pool only"
