"""Cluster config parsing and validation: the shipped files load, bad configs fail naming the field."""

from __future__ import annotations

import pytest

from cluster.config import (
    DEFAULT_CONFIG_PATH,
    VLLM_CPU_CONFIG_PATH,
    ConfigError,
    load_config,
    parse_config,
    with_overrides,
)

PREFILL = {"name": "prefill", "role": "prefill", "tp": 2}
DECODE = {"name": "tp", "role": "decode"}


def test_default_config_is_the_up_topology():
    config = load_config(DEFAULT_CONFIG_PATH)
    assert config.model == "kimi-k3.1-mini" and config.engine == "reference" and config.router.port == 8000
    shape = [(p.name, p.role, p.count, p.tp, p.dcp) for p in config.pools]
    assert shape == [("prefill", "prefill", 1, 2, 1), ("tp", "decode", 1, 1, 1), ("dcp", "decode", 1, 1, 2)]


def test_vllm_cpu_config_is_one_pair_on_distinct_cores():
    config = load_config(VLLM_CPU_CONFIG_PATH)
    assert config.engine == "vllm"
    assert [(p.role, p.cores) for p in config.pools] == [("prefill", [0]), ("decode", [1])]


def test_helm_spelling_maps_onto_the_schema():
    config = parse_config({
        "pools": [
            {"name": "prefill", "role": "prefill", "replicas": 2, "tp": 4, "extraArgs": ["--x"]},
            {"name": "dcp", "role": "decode", "dcp": 8, "maxContextTokens": 1048576, "engine": "vllm"},
        ],
        "router": {"port": 9000, "adminToken": "s3cret"},
    })
    prefill, dcp = config.pools
    assert (prefill.count, prefill.tp, prefill.extra_args) == (2, 4, ["--x"])
    assert (dcp.dcp, dcp.max_context_tokens, config.engine_of(dcp)) == (8, 1048576, "vllm")
    assert config.engine_of(prefill) == "reference" and config.router.admin_token == "s3cret"


def test_overrides_replace_engine_model_and_port_everywhere():
    config = parse_config({"pools": [dict(PREFILL, engine="reference", model="kimi-k3.1-pro"), DECODE]})
    changed = with_overrides(config, engine="vllm", model="/models/tiny", router_port=9100)
    assert changed.router.port == 9100
    assert {changed.engine_of(p) for p in changed.pools} == {"vllm"}
    assert {changed.model_of(p) for p in changed.pools} == {"/models/tiny"}


BAD = {
    "tp-not-power-of-two": ({"pools": [dict(PREFILL, tp=3), DECODE]}, "pools[0].tp: must be a power of two", "got 3"),
    "zero-count": ({"pools": [dict(PREFILL, count=0), DECODE]}, "pools[0].count", "greater than or equal to 1"),
    "unknown-role": ({"pools": [PREFILL, dict(DECODE, role="encode")]}, "pools[1].role", "'encode'"),
    "unknown-key": ({"pools": [PREFILL, dict(DECODE, tensor_parallel=2)]}, "pools[1].tensor_parallel", "not permitted"),
    "bad-name": ({"pools": [PREFILL, dict(DECODE, name="TP_pool")]}, "pools[1].name", "'TP_pool'"),
    "no-decode": ({"pools": [PREFILL]}, "at least one decode pool", ""),
    "no-prefill": ({"pools": [DECODE]}, "at least one prefill pool", ""),
    "duplicate-names": ({"pools": [PREFILL, DECODE, dict(DECODE, dcp=2)]}, "unique, repeated: tp", ""),
    "dcp-prefill": ({"pools": [dict(PREFILL, dcp=2), DECODE]}, "dcp must be 1", "prefill"),
    "tp-and-dcp": ({"pools": [PREFILL, dict(DECODE, tp=2, dcp=2)]}, "TP or DCP, not both", "'tp'"),
    "ports-count": ({"pools": [dict(PREFILL, count=2, ports=[9001]), DECODE]}, "1 ports for 2 instances", ""),
    "port-range": ({"pools": [dict(PREFILL, ports=[70000]), DECODE]}, "port 70000 is outside", ""),
    "port-twice": ({"pools": [dict(PREFILL, ports=[8000]), DECODE]}, "ports used more than once: 8000", ""),
    "engine": ({"engine": "trt", "pools": [PREFILL, DECODE]}, "engine", "'trt'"),
    "pools-missing": ({"model": "kimi-k3.1-mini"}, "pools: Field required", ""),
    "unknown-model": ({"model": "kimi-k9", "pools": [PREFILL, DECODE]}, "pool 'prefill': model 'kimi-k9'",
                      "unknown model preset"),
    "prefill-capacity": ({"pools": [dict(PREFILL, max_context_tokens=10), DECODE]}, "decode pools only", ""),
    "settings-unknown-kv": ({"pools": [dict(PREFILL, settings={"kv": {"ucx_tlss": "tcp"}}), DECODE]},
                            "pools[0]", "settings.kv.ucx_tlss"),
    "settings-bad-value": ({"pools": [PREFILL, dict(DECODE, settings={"kv": {"timeout_s": -1}})]},
                           "settings.kv.timeout_s", "greater than 0"),
    "settings-other-role": ({"pools": [dict(PREFILL, settings={"pool": "x"}), DECODE]}, "settings.pool", ""),
    "settings-decode-only": ({"pools": [dict(PREFILL, settings={"dcp": 2}), DECODE]}, "settings.dcp", ""),
    "settings-on-vllm": ({"engine": "vllm", "pools": [PREFILL, dict(DECODE, settings={"num_rows": 8})]},
                         "settings apply to reference-engine nodes", ""),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_config_names_the_field(case):
    data, *needles = BAD[case]
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml")
    for needle in needles:
        assert needle in message, message


def test_files_that_are_not_configs(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("pools: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="a mapping with a `pools` list, got list"):
        load_config(tmp_path / "list.yaml")


def test_up_model_dir_puts_one_checkpoint_on_every_pool(tmp_path):
    from cluster.cli import build_parser, resolve_config
    from cluster.plan import served_model_name

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "pdcluster_k3"}')
    config = resolve_config(build_parser().parse_args(["--model", f"{checkpoint}/"]))
    assert config.engine == "reference" and {config.model_of(p) for p in config.pools} == {f"{checkpoint}/"}
    assert served_model_name(config) == str(checkpoint)  # the nodes' id: the directory without trailing slashes
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_config(build_parser().parse_args(["--model", str(tmp_path)]))
