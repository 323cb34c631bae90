"""`device: cuda` planning without a GPU: GPUs per instance, the one-GPU topology, flags and environment of the
node command lines, config checks, `pdcluster up --device cuda` with no GPU visible, the device defaults."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, main, resolve_config
from cluster.config import DEFAULT_CONFIG_PATH, GPU1_CONFIG_PATH, ConfigError, load_config, parse_config, with_overrides
from cluster.plan import Ports, assign_gpus, gpu_sharing_note, plan_nodes, visible_gpus
from engine.parallel.groups import default_backend
from kv_transfer.ucx_env import KVTransferSettings, resolve_cuda_ipc_get_zcopy


def _ports(config) -> Ports:
    http = {"router": 9000}
    for pool in config.pools:
        for index in range(pool.count):
            http[f"{pool.name}-{index}"] = 9001 + len(http)
    return Ports(http=http, side_channel={})


def test_default_topology_spreads_one_gpu_per_rank_in_config_order() -> None:
    config = with_overrides(load_config(DEFAULT_CONFIG_PATH), device="cuda", gpus=4)
    assert assign_gpus(config, 4) == {"prefill-0": [0, 1], "tp-0": [2], "dcp-0": [0, 1]}
    assert assign_gpus(config, 8) == {"prefill-0": [0, 1], "tp-0": [2], "dcp-0": [3, 4]}
    assert gpu_sharing_note(assign_gpus(config, 8), 8) is None


def test_one_gpu_topology_shares_gpu0_and_says_so() -> None:
    config = load_config(GPU1_CONFIG_PATH)
    assert config.device == "cuda" and config.gpus == 1
    assert [(p.role, p.tp, p.dcp) for p in config.pools] == [("prefill", 1, 1), ("decode", 1, 1)]
    plans = plan_nodes(config, _ports(config))
    for plan in plans:
        assert plan.argv[plan.argv.index("--device") + 1] == "cuda"
        assert plan.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert plan.env["NCCL_NVLS_ENABLE"] == "0"
    note = gpu_sharing_note(assign_gpus(config, 1), 1)
    assert note is not None and "prefill-0 on GPU 0" in note and "tp-0 on GPU 0" in note


def test_cpu_plans_carry_no_device_flag_or_gpus() -> None:
    config = load_config(DEFAULT_CONFIG_PATH)
    assert config.device == "cpu"
    for plan in plan_nodes(config, _ports(config)):
        assert "--device" not in plan.argv
        assert "CUDA_VISIBLE_DEVICES" not in plan.env


def test_a_group_wider_than_the_host_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs 2 GPUs.*gpu1.yaml"):
        with_overrides(load_config(DEFAULT_CONFIG_PATH), device="cuda", gpus=1)
    config = with_overrides(load_config(DEFAULT_CONFIG_PATH), device="cuda")
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        assign_gpus(config, 1)
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        assign_gpus(config, 0)


def test_pool_gpus_are_checked_and_used() -> None:
    base = {"device": "cuda", "gpus": 4, "pools": [{"name": "p", "role": "prefill", "tp": 2, "gpus": [2, 3]},
                                                     {"name": "d", "role": "decode", "count": 2, "gpus": [1, 1]}]}
    config = parse_config(base)
    assert assign_gpus(config, 4) == {"p-0": [2, 3], "d-0": [1], "d-1": [1]}
    with pytest.raises(ConfigError, match="distinct GPU ids"):
        parse_config({**base, "pools": [{"name": "p", "role": "prefill", "tp": 2, "gpus": [0, 0]},
                                        base["pools"][1]]})
    with pytest.raises(ConfigError, match="3 gpus for 1 instances"):
        parse_config({**base, "pools": [{"name": "p", "role": "prefill", "tp": 2, "gpus": [0, 1, 2]},
                                        base["pools"][1]]})
    with pytest.raises(ConfigError, match=r"gpus \[5\] outside 0..3"):
        parse_config({**base, "pools": [{"name": "p", "role": "prefill", "tp": 2, "gpus": [0, 5]},
                                        base["pools"][1]]})
    with pytest.raises(ConfigError, match="device: cuda"):
        parse_config({**base, "device": "cpu"})


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,3")
    assert visible_gpus() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0


def test_up_device_cuda_with_one_gpu_runs_gpu1(monkeypatch, capsys) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    config = resolve_config(build_parser().parse_args(["--device", "cuda"]))
    assert config.device == "cuda" and [p.tp for p in config.pools] == [1, 1] and len(config.pools) == 2
    assert "cluster/gpu1.yaml" in capsys.readouterr().err
    two = resolve_config(build_parser().parse_args(["--device", "cuda", "--gpus", "2"]))
    assert two.gpus == 2 and [p.name for p in two.pools] == ["prefill", "tp", "dcp"]


def test_up_device_cuda_without_gpu_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["--device", "cuda", "--config", str(GPU1_CONFIG_PATH.with_name("default.yaml"))]) == 2
    assert "no NVIDIA GPU" in capsys.readouterr().err


def test_group_backend_follows_the_device() -> None:
    assert default_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="device"):
        default_backend("tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            default_backend("cuda")


def test_cuda_ipc_get_zcopy_defaults_on_for_vram_only() -> None:
    assert KVTransferSettings().cuda_ipc_get_zcopy == "auto"
    assert resolve_cuda_ipc_get_zcopy("auto", "VRAM") == "y"
    assert resolve_cuda_ipc_get_zcopy("auto", "DRAM") is None
    assert resolve_cuda_ipc_get_zcopy("n", "VRAM") == "n"
    with pytest.raises(ValueError):
        resolve_cuda_ipc_get_zcopy("maybe", "VRAM")
