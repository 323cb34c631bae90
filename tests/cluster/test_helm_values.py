"""The chart's example values map onto the cluster config schema (one schema for both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
from cluster.helm import config_from_helm_values, load_helm_values

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdcluster"


def _shape(config):
    return [(p.name, p.role, p.count, p.tp, p.dcp, config.engine_of(p), config.model_of(p)) for p in config.pools]


def test_cpu_dev_values_are_the_up_topology():
    assert _shape(load_helm_values(CHART / "values-cpu-dev.yaml")) == _shape(load_config(DEFAULT_CONFIG_PATH))


def test_gb300_values_parse_as_vllm_tp8_and_dcp8_pools():
    config = load_helm_values(CHART / "values-gb300-tp8-dcp8.yaml")
    assert {config.engine_of(p) for p in config.pools} == {"vllm"}
    assert {(p.role, p.tp, p.dcp) for p in config.pools} >= {("prefill", 8, 1)}
    assert any(p.role == "decode" and p.dcp == 8 for p in config.pools)


def test_helm_env_list_and_zero_replicas():
    config = config_from_helm_values({
        "poolDefaults": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
        "pools": [{"name": "p", "role": "prefill", "image": {"repository": "x"}, "port": 8000},
                  {"name": "d", "role": "decode", "env": [{"name": "A", "value": "b"}], "maxContextTokens": 99},
                  {"name": "off", "role": "decode", "replicas": 0}],
    })
    assert [p.name for p in config.pools] == ["p", "d"]
    assert config.pools[1].env == {"OMP_NUM_THREADS": "1", "A": "b"} and config.pools[1].max_context_tokens == 99


def test_pool_settings_map_one_to_one():
    settings = {"num_rows": 64, "kv": {"ucx_tls": "tcp"}}
    config = config_from_helm_values({"pools": [{"name": "p", "role": "prefill", "settings": settings},
                                                {"name": "d", "role": "decode"}]})
    assert config.pools[0].settings == settings and config.pools[1].settings == {}


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"pools\[1\].tp: must be a power of two"):
        config_from_helm_values({"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "tp": 6}]})
    with pytest.raises(ConfigError, match="need a `pools` list"):
        config_from_helm_values({"router": {}})
