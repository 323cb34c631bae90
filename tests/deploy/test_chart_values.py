"""What the chart renders from pool values: vLLM and reference command lines, the LWS shape of multi-node
pools, RBAC scope, NetworkPolicy, discovery labels the router reads, the router config the router loads,
and values the schema (or the chart's own checks) must refuse.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from cluster.config import parse_config
from router.config import RouterConfig
from router.discovery import pod_to_spec
from tests.deploy.helm_support import CHART, NAMESPACE, RELEASE, Rendered, arg_value, render, render_error

pytestmark = pytest.mark.process

GB300 = "values-gb300-tp8-dcp8.yaml"
CPU_DEV = "values-cpu-dev.yaml"


@pytest.fixture(scope="module")
def gb300() -> Rendered:
    return render(GB300)


@pytest.fixture(scope="module")
def cpu_dev() -> Rendered:
    return render(CPU_DEV)


def _leader(out: Rendered, pool: str):
    (leader,) = [pod for pod in out.pool_pods(pool) if pod.part == "leader"]
    return leader


def test_vllm_tp8_prefill_args(gb300: Rendered) -> None:
    pod = _leader(gb300, "prefill-tp8")
    c = pod.container
    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    assert args[0] == "/models/Kimi-K3.1-Pro"
    assert arg_value(args, "--tensor-parallel-size") == "8"
    assert "--decode-context-parallel-size" not in args
    assert json.loads(arg_value(args, "--kv-transfer-config")) == {"kv_connector": "NixlConnector",
                                                                   "kv_role": "kv_producer"}
    assert arg_value(args, "--served-model-name") == "kimi-k3.1-pro"
    assert arg_value(args, "--port") == "8000"
    assert arg_value(args, "--max-num-batched-tokens") == "32768"  # the pool's extraArgs
    buckets = json.loads(arg_value(args, "--custom-histogram-buckets"))["time_to_first_token"]
    assert 2.0 in buckets and buckets == sorted(buckets)
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST"), "$(POD_IP) needs POD_IP defined first"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"


def test_vllm_tp8_decode_and_dcp8_decode_args(gb300: Rendered) -> None:
    tp_args = _leader(gb300, "decode-tp8").container["args"]
    dcp_args = _leader(gb300, "decode-dcp8").container["args"]
    for args in (tp_args, dcp_args):
        assert arg_value(args, "--tensor-parallel-size") == "8"
        assert json.loads(arg_value(args, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    assert "--decode-context-parallel-size" not in tp_args
    assert arg_value(dcp_args, "--decode-context-parallel-size") == "8"


def test_multi_node_pools_are_leaderworkersets(gb300: Rendered) -> None:
    assert not [d for d in gb300.of_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "node"]
    sets = {d["metadata"]["labels"]["pdcluster.io/pool"]: d for d in gb300.of_kind("LeaderWorkerSet")}
    assert set(sets) == {"prefill-tp8", "decode-tp8", "decode-dcp8"}
    assert sets["prefill-tp8"]["spec"]["replicas"] == 4
    for pool, lws in sets.items():
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lwt["size"] == 2, "TP8 on 4-GPU GB300 nodes: 2 nodes per instance"
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader, worker = _leader(gb300, pool), [p for p in gb300.pool_pods(pool) if p.part == "worker"][0]
        for pod, rank in ((leader, "0"), (worker, "$(LWS_WORKER_INDEX)")):
            args, res = pod.container["args"], pod.container["resources"]
            assert arg_value(args, "--nnodes") == "2"
            assert arg_value(args, "--node-rank") == rank
            assert arg_value(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
            assert res["limits"]["nvidia.com/gpu"] == 4 and res["limits"]["rdma/ib"] == 1
            assert pod.container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
            assert {"name": "nvlink-channel"} in res["claims"]
            clique = pod.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert clique["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.clique"
            (same,) = pod.spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert same["topologyKey"] == "nvidia.com/gpu.clique"
            assert same["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
            assert pod.spec["volumes"][0]["emptyDir"]["medium"] == "Memory"
        assert "--headless" in worker.container["args"] and "--headless" not in leader.container["args"]
        assert [p["name"] for p in worker.container["ports"]] == ["nixl-side"], "workers serve no HTTP"
        assert "readinessProbe" not in worker.container and "readinessProbe" in leader.container
        assert leader.labels["pdcluster.io/role"] == ("prefill" if "prefill" in pool else "decode")
        assert "pdcluster.io/role" not in worker.labels, "router discovery must skip LWS workers"


def test_single_node_pools_are_deployments_with_reference_args(cpu_dev: Rendered) -> None:
    assert not cpu_dev.of_kind("LeaderWorkerSet")
    args = {pool: cpu_dev.pool_pods(pool)[0].container for pool in ("prefill", "tp", "dcp")}
    assert all(c["command"] == ["pdcluster"] for c in args.values())
    assert args["prefill"]["args"] == ["prefill", "--model", "kimi-k3.1-mini", "--tp", "2", "--port", "8000",
                                       "--host", "0.0.0.0"]
    assert args["tp"]["args"] == ["decode", "--model", "kimi-k3.1-mini", "--tp", "1", "--port", "8000",
                                  "--host", "0.0.0.0", "--pool", "tp"]
    assert args["dcp"]["args"] == ["decode", "--model", "kimi-k3.1-mini", "--dcp", "2", "--port", "8000",
                                   "--host", "0.0.0.0", "--pool", "dcp"]
    for container in args.values():
        limits = container["resources"].get("limits", {})
        assert "nvidia.com/gpu" not in limits and "rdma/ib" not in limits
        assert "IPC_LOCK" not in container["securityContext"]["capabilities"].get("add", []), "no RDMA, no IPC_LOCK"


def test_router_rbac_is_pods_read_only_in_its_namespace(gb300: Rendered) -> None:
    assert not gb300.of_kind("ClusterRole") and not gb300.of_kind("ClusterRoleBinding")
    (role,) = gb300.of_kind("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = gb300.of_kind("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    router = gb300.named("Deployment", f"{RELEASE}-pdcluster-router")
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    for pod in gb300.pod_templates():
        if pod.labels["app.kubernetes.io/component"] == "node":
            assert pod.spec["serviceAccountName"] != account and pod.spec["automountServiceAccountToken"] is False


def test_network_policy_only_router_reaches_node_http(gb300: Rendered) -> None:
    policies = {p["metadata"]["name"]: p for p in gb300.of_kind("NetworkPolicy")}
    nodes = policies[f"{RELEASE}-pdcluster-nodes"]["spec"]
    assert nodes["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "node"
    assert nodes["policyTypes"] == ["Ingress", "Egress"]
    http_rules = [rule for rule in nodes["ingress"] if rule.get("ports") == [{"port": "http", "protocol": "TCP"}]]
    peers = [peer for rule in http_rules for peer in rule["from"]]
    pod_peers = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in peers
                 if "podSelector" in peer]
    assert pod_peers == ["router"], "only router pods (and the metrics namespace) reach node HTTP ports"
    assert all("ports" in rule for rule in nodes["ingress"]), "no rule opens every port"
    node_to_node = [rule for rule in nodes["ingress"]
                    if rule["from"][0].get("podSelector", {}).get("matchLabels", {}).get(
                        "app.kubernetes.io/component") == "node"]
    assert len(node_to_node) == 1  # side channel on the HTTP port, vLLM's side channel, UCX (test_chart_secrets)
    # Every serving pod names its HTTP port `http`, which the policy refers to.
    for pod in gb300.pod_templates():
        if pod.labels.get("pdcluster.io/serving") == "true":
            assert "http" in {p["name"] for p in pod.container["ports"]}


def test_discovery_labels_map_to_router_instances(gb300: Rendered, cpu_dev: Rendered) -> None:
    for out in (gb300, cpu_dev):
        for pod in out.pod_templates():
            if pod.labels["app.kubernetes.io/component"] != "node":
                continue
            fake = SimpleNamespace(
                metadata=SimpleNamespace(namespace=NAMESPACE, name="pod-0", labels=pod.labels,
                                         annotations=pod.metadata.get("annotations", {}), deletion_timestamp=None),
                status=SimpleNamespace(pod_ip="10.1.2.3", phase="Running",
                                       conditions=[SimpleNamespace(type="Ready", status="True")]))
            spec = pod_to_spec(fake)
            if pod.part == "worker":
                assert spec is None
                continue
            args = pod.container["args"]
            assert spec.url == f"http://10.1.2.3:{arg_value(args, '--port')}"
            assert spec.pool == pod.labels["pdcluster.io/pool"] and spec.ready
            assert spec.engine == ("vllm" if pod.container["command"][0] == "vllm" else "reference")
            dcp = arg_value(args, "--decode-context-parallel-size") or arg_value(args, "--dcp") or "1"
            assert spec.dcp == int(dcp)
            # the router's tp is the TP group width, DCP ranks included (a reference `--dcp W` node runs W ranks)
            tp = arg_value(args, "--tensor-parallel-size") or arg_value(args, "--tp") or "1"
            assert spec.tp == max(int(tp), int(dcp)) and spec.tp % spec.dcp == 0


@pytest.mark.parametrize("values", [GB300, CPU_DEV, "values.yaml"])
def test_router_config_loads_in_the_router_and_selects_serving_pods(values: str) -> None:
    out = render(values)
    (cm,) = [c for c in out.of_kind("ConfigMap") if "router.yaml" in c.get("data", {})]
    config = RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"]))
    pools = yaml.safe_load((CHART / values).read_text())["pools"]
    decode = [p for p in pools if p["role"] == "decode"]
    assert [p.name for p in config.pools] == [p["name"] for p in decode]
    assert [p.kind for p in config.pools] == ["dcp" if p.get("dcp", 1) > 1 else "tp" for p in decode]
    assert config.kubernetes.namespace == NAMESPACE
    selector = dict(term.split("=") for term in config.kubernetes.label_selector.split(","))
    serving = [p for p in out.pod_templates() if p.labels.get("pdcluster.io/serving") == "true"]
    assert serving and all(selector.items() <= p.labels.items() for p in serving)
    others = [p for p in out.pod_templates() if p.labels.get("pdcluster.io/serving") != "true"]
    assert not any(selector.items() <= p.labels.items() for p in others)
    router = out.named("Deployment", f"{RELEASE}-pdcluster-router")["spec"]["template"]["spec"]
    assert router["containers"][0]["args"][:3] == ["router", "--config", "/etc/pdcluster/router.yaml"]


@pytest.mark.parametrize("values", [GB300, CPU_DEV])
def test_pools_are_valid_cluster_configs(values: str) -> None:
    """The `pools` block of each example reads as a `pdcluster up` config (cluster/config.py)."""
    data = yaml.safe_load((CHART / values).read_text())
    chart_only = {"image", "resources", "nodesPerInstance", "port", "nodeSelector", "tolerations", "env"}
    pools = [{k: v for k, v in pool.items() if k not in chart_only} for pool in data["pools"]]
    config = parse_config({"model": data["servedModelName"], "pools": pools}, values)
    assert [p.name for p in config.pools] == [p["name"] for p in data["pools"]]


BAD_VALUES = {
    "tp-not-power-of-two": ({"pools": [{"name": "p", "role": "prefill", "tp": 3},
                                       {"name": "d", "role": "decode"}]}, "tp"),
    "prefill-with-dcp": ({"pools": [{"name": "p", "role": "prefill", "dcp": 2},
                                    {"name": "d", "role": "decode"}]}, "dcp"),
    "unknown-pool-field": ({"pools": [{"name": "p", "role": "prefill", "gpus": 8},
                                      {"name": "d", "role": "decode"}]}, "gpus"),
    "bad-engine": ({"pools": [{"name": "p", "role": "prefill", "engine": "sglang"},
                              {"name": "d", "role": "decode"}]}, "engine"),
    "bad-pool-name": ({"pools": [{"name": "Prefill_1", "role": "prefill"}, {"name": "d", "role": "decode"}]}, "name"),
    "no-decode-pool": ({"pools": [{"name": "p", "role": "prefill"}, {"name": "q", "role": "prefill"}]}, "contains"),
    "bad-role": ({"pools": [{"name": "p", "role": "both"}, {"name": "d", "role": "decode"}]}, "role"),
    "nodes-per-instance-3": ({"pools": [{"name": "p", "role": "prefill", "tp": 8, "nodesPerInstance": 3},
                                        {"name": "d", "role": "decode"}]}, "nodesPerInstance"),
    "unknown-top-level": ({"routr": {"replicas": 2}}, "routr"),
    "router-zero-replicas": ({"router": {"replicas": 0}}, "replicas"),
    # Checks in the templates (beyond JSON schema):
    "gpus-exceed-node": ({"pools": [{"name": "p", "role": "prefill", "tp": 8, "engine": "vllm"},
                                    {"name": "d", "role": "decode"}]}, "gpu.perNode"),
    "vllm-tp-not-divisible-by-dcp": ({"pools": [{"name": "p", "role": "prefill"},
                                                {"name": "d", "role": "decode", "tp": 2, "dcp": 4,
                                                 "engine": "vllm", "nodesPerInstance": 1}]}, "divisible by dcp"),
    "reference-tp-and-dcp": ({"pools": [{"name": "p", "role": "prefill"},
                                        {"name": "d", "role": "decode", "tp": 2, "dcp": 2}]}, "TP or DCP"),
    "reference-multi-node": ({"pools": [{"name": "p", "role": "prefill", "tp": 8, "nodesPerInstance": 2},
                                        {"name": "d", "role": "decode"}]}, "one node"),
    "duplicate-pool": ({"pools": [{"name": "p", "role": "prefill"}, {"name": "p", "role": "decode"}]}, "unique"),
    "router-head-timeout-in-settings": ({"router": {"settings": {"head_read_timeout_s": 5}}},
                                        "router.headReadTimeoutS"),
    "router-pipelining-in-settings": ({"router": {"settings": {"max_pipelined_requests": 5}}},
                                      "router.maxPipelinedRequests"),
    "router-zero-pipelined": ({"router": {"maxPipelinedRequests": 0}}, "maxPipelinedRequests"),
    "router-zero-head-timeout": ({"router": {"headReadTimeoutS": 0}}, "headReadTimeoutS"),
    "node-head-timeout-in-settings": ({"pools": [{"name": "p", "role": "prefill"},
                                                 {"name": "d", "role": "decode",
                                                  "settings": {"http_head_timeout_s": 3}}]}, "httpHeadTimeoutS"),
    "vllm-pool-head-timeout": ({"pools": [{"name": "p", "role": "prefill", "engine": "vllm", "tp": 1,
                                           "httpHeadTimeoutS": 3}, {"name": "d", "role": "decode"}]},
                               "reference-engine"),
    "vllm-pool-settings": ({"pools": [{"name": "p", "role": "prefill", "engine": "vllm", "tp": 1,
                                       "settings": {"kv": {"ucx_tls": "tcp"}}},
                                      {"name": "d", "role": "decode"}]}, "reference-engine"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused(case: str, tmp_path) -> None:
    values, needle = BAD_VALUES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(values))
    error = render_error(path)
    assert needle in error, f"{case}: helm refused, but not for {needle!r}:\n{error}"


def test_pool_settings_render_as_the_role_env_and_read_back(tmp_path, monkeypatch) -> None:
    """`settings` of a reference pool become PREFILL_/DECODE_ env that the node's Settings read back (the same
    names cluster/plan.py gives `pdcluster up`)."""
    from cluster.plan import settings_env
    from decode_node.settings import Settings as DecodeSettings

    settings = {"num_rows": 512, "kv": {"ucx_tls": "rc,sm,self", "timeout_s": 12.5, "capture_telemetry": False}}
    out = render(CPU_DEV, overrides={"pools": [
        {"name": "prefill", "role": "prefill", "tp": 2, "engine": "reference"},
        {"name": "tp", "role": "decode", "engine": "reference", "settings": settings}]}, tmp_dir=tmp_path)
    env = {item["name"]: item["value"] for item in out.pool_pods("tp")[0].container["env"] if "value" in item}
    chart_env = {"DECODE_ADVERTISE_HOST": "$(POD_IP)", "DECODE_METRICS_PORT": "9100",  # every reference pod's
                 "DECODE_DRAIN_S": "55",  # the grace period (60 s) minus 5 s
                 "DECODE_HTTP_HEAD_TIMEOUT_S": "10",  # poolDefaults.httpHeadTimeoutS
                 "DECODE_REQUIRE_READER": "true",  # the chart's router binds every hand-off
                 "DECODE_CLUSTER_SECRET_FILE": "/var/run/pdcluster/cluster-secret/cluster-secret"}
    assert {k: v for k, v in env.items() if k.startswith("DECODE_")} == settings_env("DECODE_", settings) | chart_env
    assert not any(k.startswith("PREFILL_") for k in env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    node = DecodeSettings()
    assert (node.engine.num_rows, node.kv.ucx_tls, node.kv.timeout_s, node.kv.capture_telemetry) == (
        512, "rc,sm,self", 12.5, False)


def test_connection_limits_reach_the_router_and_the_nodes(tmp_path, monkeypatch) -> None:
    """`router.headReadTimeoutS` / `router.maxPipelinedRequests` land in the router's Settings, and
    `httpHeadTimeoutS` (poolDefaults, a pool's own wins) in each reference node's: what the processes run with."""
    from decode_node.settings import Settings as DecodeSettings
    from prefill_node.settings import Settings as PrefillSettings
    from router.settings import Settings as RouterSettings

    out = render(CPU_DEV, overrides={
        "router": {"headReadTimeoutS": 2.5, "maxPipelinedRequests": 4}, "poolDefaults": {"httpHeadTimeoutS": 7},
        "pools": [{"name": "prefill", "role": "prefill", "tp": 2, "engine": "reference"},
                  {"name": "tp", "role": "decode", "engine": "reference", "httpHeadTimeoutS": 3.5}]}, tmp_dir=tmp_path)
    (cm,) = [c for c in out.of_kind("ConfigMap") if "router.yaml" in c.get("data", {})]
    router = RouterSettings(**RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"])).router)
    assert (router.head_read_timeout_s, router.max_pipelined_requests) == (2.5, 4)
    for pool, settings_cls, expected in (("prefill", PrefillSettings, 7.0), ("tp", DecodeSettings, 3.5)):
        env = {item["name"]: item["value"] for item in out.pool_pods(pool)[0].container["env"] if "value" in item}
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            assert settings_cls().http_head_timeout_s == expected, pool
    defaults = RouterSettings()
    (cm,) = [c for c in render(CPU_DEV).of_kind("ConfigMap") if "router.yaml" in c.get("data", {})]
    rendered = yaml.safe_load(cm["data"]["router.yaml"])["router"]
    assert (rendered["head_read_timeout_s"], rendered["max_pipelined_requests"]) == (
        defaults.head_read_timeout_s, defaults.max_pipelined_requests), "the chart's defaults are the router's"


def test_reference_nodes_refuse_unbound_handoffs_unless_a_pool_says_otherwise(tmp_path, monkeypatch) -> None:
    """The chart's router binds every hand-off to its reader (router/readers.py), so the chart's reference nodes run
    with `require_reader` (node/settings.py); a pool's own `settings.require_reader` is the one value it gets."""
    from decode_node.settings import Settings as DecodeSettings
    from prefill_node.settings import Settings as PrefillSettings

    out = render(CPU_DEV, overrides={
        "pools": [{"name": "prefill", "role": "prefill", "tp": 2, "engine": "reference"},
                  {"name": "tp", "role": "decode", "engine": "reference"},
                  {"name": "open", "role": "decode", "engine": "reference", "settings": {"require_reader": False}}]},
        tmp_dir=tmp_path)
    for pool, settings_cls, expected in (("prefill", PrefillSettings, True), ("tp", DecodeSettings, True),
                                         ("open", DecodeSettings, False)):
        items = [item for item in out.pool_pods(pool)[0].container["env"] if item["name"].endswith("_REQUIRE_READER")]
        assert len(items) == 1, (pool, items)
        with monkeypatch.context() as patch:
            for item in out.pool_pods(pool)[0].container["env"]:
                if "value" in item:
                    patch.setenv(item["name"], item["value"])
            assert settings_cls().require_reader is expected, pool
