"""Command lines, environments and the router registry built for each node kind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cluster.config import DEFAULT_CONFIG_PATH, VLLM_CPU_CONFIG_PATH, ConfigError, load_config, parse_config
from cluster.plan import VLLM_SITE_DIR, assign_ports, plan_nodes, plan_router, router_config


def _by_name(plans):
    return {plan.name: plan for plan in plans}


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_reference_command_lines():
    config = load_config(DEFAULT_CONFIG_PATH)
    ports = assign_ports(config)
    nodes = _by_name(plan_nodes(config, ports, python="/py"))
    assert list(nodes) == ["prefill-0", "tp-0", "dcp-0"]
    prefill, tp, dcp = nodes["prefill-0"], nodes["tp-0"], nodes["dcp-0"]
    assert prefill.argv == ("/py", "-m", "pdcluster.cli", "prefill", "--model", "kimi-k3.1-mini",
                            "--port", str(ports.http["prefill-0"]), "--host", "127.0.0.1", "--tp", "2")
    assert tp.argv[3] == "decode" and _flag(tp.argv, "--tp") == "1" and _flag(tp.argv, "--pool") == "tp"
    assert "--dcp" not in tp.argv
    assert _flag(dcp.argv, "--dcp") == "2" and _flag(dcp.argv, "--pool") == "dcp" and "--tp" not in dcp.argv
    assert (dcp.role, dcp.pool, dcp.dcp, dcp.url) == ("decode", "dcp", 2, f"http://127.0.0.1:{ports.http['dcp-0']}")
    assert not ports.side_channel  # no vLLM instance, no side channel


def test_pool_settings_become_the_role_env(monkeypatch):
    """A pool's `settings` reach each instance as its role's environment, read back by the node's Settings;
    the pool's own `env` wins over them."""
    from decode_node.settings import Settings as DecodeSettings
    from prefill_node.settings import Settings as PrefillSettings

    config = parse_config({"pools": [
        {"name": "p", "role": "prefill", "settings": {"lease_seconds": 5, "kv": {"ucx_tls": "tcp", "num_threads": 2}}},
        {"name": "d", "role": "decode", "settings": {"kv": {"timeout_s": 4, "capture_telemetry": False}},
         "env": {"DECODE_KV__TIMEOUT_S": "6"}}]})
    nodes = _by_name(plan_nodes(config, assign_ports(config)))
    assert nodes["p-0"].env == {"PREFILL_LEASE_SECONDS": "5", "PREFILL_KV__UCX_TLS": "tcp",
                                "PREFILL_KV__NUM_THREADS": "2"}
    assert nodes["d-0"].env == {"DECODE_KV__TIMEOUT_S": "6", "DECODE_KV__CAPTURE_TELEMETRY": "false"}
    for plan in nodes.values():
        for name, value in plan.env.items():
            monkeypatch.setenv(name, value)
    prefill, decode = PrefillSettings(), DecodeSettings()
    assert (prefill.lease_seconds, prefill.kv.ucx_tls, prefill.kv.num_threads) == (5.0, "tcp", 2)
    assert (decode.kv.timeout_s, decode.kv.capture_telemetry, decode.kv.ucx_tls) == (6.0, False, "auto")


def test_ports_are_distinct_and_configured_ports_kept():
    config = parse_config({
        "router": {"port": None},
        "pools": [{"name": "p", "role": "prefill", "count": 3}, {"name": "d", "role": "decode", "ports": [18123]}],
    })
    ports = assign_ports(config)
    assert ports.http["d-0"] == 18123
    assert len(set(ports.http.values())) == len(ports.http) == 5
    # picked ports lie below the kernel's ephemeral range: no outgoing connection can hold one before a node binds
    from engine.ports import LOWEST_PORT, ephemeral_port_range

    lo, _ = ephemeral_port_range()
    assert all(LOWEST_PORT <= port < lo for name, port in ports.http.items() if name != "d-0")


def test_vllm_producer_consumer_on_cpu(tmp_path):
    config = load_config(VLLM_CPU_CONFIG_PATH).model_copy(update={"model": str(tmp_path / "tiny-llama")})
    ports = assign_ports(config)
    nodes = _by_name(plan_nodes(config, ports))
    prefill, decode = nodes["prefill-0"], nodes["tp-0"]
    for plan, role, core in ((prefill, "kv_producer", "0"), (decode, "kv_consumer", "1")):
        assert plan.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
        assert _flag(plan.argv, "--model") == str(tmp_path / "tiny-llama")
        assert _flag(plan.argv, "--served-model-name") == "tiny-llama"
        assert _flag(plan.argv, "--port") == str(plan.port)
        assert json.loads(_flag(plan.argv, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == core
        assert plan.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert plan.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and plan.env["HF_HUB_OFFLINE"] == "1"
        assert plan.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        # NIXL's progress thread waits between passes (cluster/vllm_site): no core spent idle per instance
        assert plan.env["PDCLUSTER_NIXL_PROGRESS_DELAY_US"] == "2000"
        assert plan.env["PYTHONPATH"].split(os.pathsep)[0] == str(VLLM_SITE_DIR)
    side = {prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"], decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]}
    assert len(side) == 2 and not side & {str(p) for p in ports.http.values()}


def test_vllm_nixl_progress_delay_is_a_setting(monkeypatch):
    """Unset: NIXL's busy loop on GPUs; set: that delay on either device, the inherited PYTHONPATH kept after."""
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    pools = [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]
    gpu = parse_config({"engine": "vllm", "model": "/m/x", "vllm": {"cpu": False}, "pools": pools})
    assert all("PDCLUSTER_NIXL_PROGRESS_DELAY_US" not in plan.env and "PYTHONPATH" not in plan.env
               for plan in plan_nodes(gpu, assign_ports(gpu)))
    for cpu in (False, True):
        config = parse_config({"engine": "vllm", "model": "/m/x", "pools": pools,
                               "vllm": {"cpu": cpu, "nixlProgressDelayUs": 500}})
        for plan in plan_nodes(config, assign_ports(config)):
            assert plan.env["PDCLUSTER_NIXL_PROGRESS_DELAY_US"] == "500"
            assert plan.env["PYTHONPATH"] == os.pathsep.join([str(VLLM_SITE_DIR), "/elsewhere"])
    with pytest.raises(ConfigError):
        parse_config({"engine": "vllm", "model": "/m/x", "pools": pools, "vllm": {"nixl_progress_delay_us": -1}})


def test_vllm_dcp_and_gpu_settings():
    config = parse_config({
        "engine": "vllm", "model": "/m/kimi", "vllm": {"cpu": False, "python": "/venv/bin/python"},
        "pools": [{"name": "p", "role": "prefill", "tp": 8}, {"name": "dcp", "role": "decode", "tp": 8, "dcp": 8}],
    })
    nodes = _by_name(plan_nodes(config, assign_ports(config)))
    dcp = nodes["dcp-0"]
    assert dcp.argv[0] == "/venv/bin/python"
    assert _flag(dcp.argv, "--tensor-parallel-size") == "8"
    assert nodes["p-0"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert dcp.env["CUDA_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
    assert _flag(dcp.argv, "--decode-context-parallel-size") == "8"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in dcp.env and "VLLM_NIXL_SIDE_CHANNEL_PORT" in dcp.env
    assert "kv_buffer_device" not in json.loads(_flag(dcp.argv, "--kv-transfer-config"))


def test_vllm_dcp_pool_runs_inside_a_tp_group_of_its_width():
    config = load_config(DEFAULT_CONFIG_PATH).model_copy(update={"engine": "vllm", "model": "/m/x"})
    dcp = _by_name(plan_nodes(config, assign_ports(config)))["dcp-0"]
    assert _flag(dcp.argv, "--tensor-parallel-size") == "2"
    assert _flag(dcp.argv, "--decode-context-parallel-size") == "2"


def test_router_plan_and_registry_match_the_router_schema(tmp_path):
    from router.config import RouterConfig

    config = parse_config({
        "router": {"port": None, "admin_token": "tok", "settings": {"session_growth_tokens": 64}},
        "pools": [{"name": "prefill", "role": "prefill", "tp": 2},
                  {"name": "tp", "role": "decode", "max_context_tokens": 512},
                  {"name": "dcp", "role": "decode", "dcp": 2}],
    })
    ports = assign_ports(config)
    nodes = plan_nodes(config, ports, python="/py")
    router = plan_router(config, ports, tmp_path / "router.yaml", python="/py")
    assert router.argv == ("/py", "-m", "pdcluster.cli", "router", "--config", str(tmp_path / "router.yaml"),
                           "--port", str(ports.http["router"]), "--host", "127.0.0.1")
    registry = RouterConfig.model_validate(router_config(config, nodes))
    assert [(p.name, p.kind, p.max_context_tokens) for p in registry.pools] == [("tp", "tp", 512), ("dcp", "dcp", None)]
    assert [(i.name, i.role, i.pool, i.tp, i.dcp, i.engine) for i in registry.instances] == [
        ("prefill-0", "prefill", "prefill", 2, 1, "reference"),
        ("tp-0", "decode", "tp", 1, 1, "reference"),
        ("dcp-0", "decode", "dcp", 2, 2, "reference"),  # tp = the TP group width, DCP ranks included
    ]
    # the pairing matrix the router computes from this registry accepts prefill TP=2 -> both decode pools
    from router.compat import Geometry, pair_verdict

    def geometry(i):  # noqa: ANN001, ANN202
        return Geometry(name=i.name, engine=i.engine, model="m", tp=i.tp, dcp=i.dcp, block_size=1024,
                        cache_dtype="fp8", layout_fingerprint="f", weights="w")

    prefill, *decodes = registry.instances
    assert [pair_verdict(geometry(prefill), geometry(d)).reasons for d in decodes] == [(), ()]
    assert registry.router == {"session_growth_tokens": 64, "admin_token": "tok"}
    assert all(i.url == f"http://127.0.0.1:{ports.http[i.name]}" for i in registry.instances)
    assert Path(router.argv[5]).name == "router.yaml"
