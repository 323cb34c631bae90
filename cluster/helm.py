"""Helm values -> cluster config: the chart's `pools` list is the cluster config's `pools` list.

The chart (deploy/helm/pdcluster) adds Kubernetes-only fields to each pool (image, resources,
nodesPerInstance, port, nodeSelector, tolerations); they have no meaning on one machine and are dropped.
`env` is a list of `{name, value}` in Helm and a mapping here; pools scaled to `replicas: 0` are left out;
`servedModelName` becomes the vLLM served name. Everything else maps one to one, so a values file runs
locally with `pdcluster up --config` after `config_from_helm_values`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.config import ClusterConfig, ConfigError, parse_config

KUBERNETES_ONLY = ("image", "resources", "nodesPerInstance", "port", "nodeSelector", "tolerations")


def _pool(values: dict, defaults_env: list[dict]) -> dict:
    pool = {key: value for key, value in values.items() if key not in KUBERNETES_ONLY}
    env_list = [*defaults_env, *(pool.pop("env", None) or [])]
    env = {item["name"]: str(item.get("value", "")) for item in env_list if "name" in item}
    if env:
        pool["env"] = env
    return pool


def config_from_helm_values(values: dict, source: str = "<values>") -> ClusterConfig:
    """The cluster config a Helm values document describes (validated, errors name the field)."""
    if not isinstance(values, dict) or not isinstance(values.get("pools"), list):
        raise ConfigError(f"{source}: Helm values need a `pools` list")
    defaults_env = (values.get("poolDefaults") or {}).get("env") or []
    pools = [_pool(pool, defaults_env) for pool in values["pools"] if pool.get("replicas", 1) != 0]
    data: dict = {"pools": pools, "router": {"port": 8000}}
    models = {pool.get("model") for pool in pools if pool.get("model")}
    if len(models) == 1:
        data["model"] = models.pop()
    engines = {pool.get("engine") for pool in pools if pool.get("engine")}
    if len(engines) == 1:
        data["engine"] = engines.pop()
    if values.get("referenceDevice"):
        data["device"] = values["referenceDevice"]
    if values.get("servedModelName") and data.get("engine") == "vllm":
        data["vllm"] = {"served_model_name": values["servedModelName"]}
    return parse_config(data, source)


def load_helm_values(path: str | Path) -> ClusterConfig:
    path = Path(path)
    return config_from_helm_values(yaml.safe_load(path.read_text()), str(path))
