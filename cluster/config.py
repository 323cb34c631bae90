"""The cluster config schema: which pools run, with what parallelism, engine, ports and model.

One YAML file describes a whole PD cluster. The same schema is what the Helm chart's values map onto
(`pools:` is a list of `{name, role, replicas|count, tp, dcp, engine, model, settings, extraArgs, env}`), so a file that
`pdcluster up` accepts reads like the `pools` block of a values file. Keys accept both snake_case and the
Helm camelCase spelling (`extra_args` / `extraArgs`, `count` / `replicas`).

Invariants after validation:
- pool names are unique DNS labels; there is at least one prefill pool and one decode pool;
- a prefill pool has `dcp == 1` (prefill is token-sharded over its TP group);
- a decode pool is either TP (`tp >= 1, dcp == 1`) or DCP (`dcp > 1, tp == 1`) on the reference engine;
- tp and dcp are powers of two (block sizes across TP sizes must divide each other);
- `ports`, when given, has one entry per instance; no port is used twice anywhere in the file;
- `device: cuda`: every instance's group fits the host's `gpus` (one GPU per rank); a pool's `gpus` lists
  `count * world_size` ids, distinct within an instance;
- a pool's `settings` are valid fields of its role's node Settings (prefill_node/settings.py,
  decode_node/settings.py; nested sections as mappings: `kv: {ucx_tls: tcp}`), none of those the pool
  itself sets (model, host, port, tp, dcp, pool), and only on reference-engine pools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decode_node.settings import Settings as DecodeSettings
from node.settings import NodeSettings
from prefill_node.settings import Settings as PrefillSettings

Role = Literal["prefill", "decode"]
Engine = Literal["reference", "vllm"]
DEFAULT_MODEL = "kimi-k3.1-mini"
DEFAULT_CONFIG_PATH = Path(__file__).with_name("default.yaml")
VLLM_CPU_CONFIG_PATH = Path(__file__).with_name("vllm-cpu.yaml")
GPU1_CONFIG_PATH = Path(__file__).with_name("gpu1.yaml")


POOL_OWNED_SETTINGS = ("model", "host", "port", "tp", "dcp", "pool")
"""Node settings a pool spec sets through its own fields (and the launcher passes as flags)."""


def node_settings_class(role: Role) -> type[NodeSettings]:
    """The node Settings class of a role (its fields are what a pool's `settings` may set)."""
    return PrefillSettings if role == "prefill" else DecodeSettings


class ConfigError(ValueError):
    """A cluster config that cannot be used; the message names the file, the field and the bad value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


class PoolSpec(_Strict):
    """One pool of identical instances (a Deployment or LeaderWorkerSet in the Helm chart)."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """Pool name (DNS label); decode pools are what the router places sessions on (`tp`, `dcp`)."""
    role: Role
    """`prefill` or `decode`."""
    count: int = Field(1, ge=1, le=64, validation_alias=AliasChoices("count", "replicas"))
    """Instances in the pool (Helm: `replicas`)."""
    tp: int = Field(1, ge=1, le=64)
    """Tensor-parallel ranks per instance (prefill: the token-sharded group)."""
    dcp: int = Field(1, ge=1, le=64)
    """Decode-context-parallel ranks per instance (decode pools only)."""
    engine: Engine | None = None
    """`reference` or `vllm`; unset means the cluster's engine."""
    model: str | None = None
    """Reference: a preset, a ModelConfig JSON file or a checkpoint directory; vllm: a model directory. Unset means
    the cluster's model."""
    ports: list[int] | None = None
    """HTTP port per instance; unset means free ports chosen at start."""
    extra_args: list[str] = Field(default_factory=list, validation_alias=AliasChoices("extra_args", "extraArgs"))
    """Arguments appended to every instance's command line."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment added to every instance."""
    max_context_tokens: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_context_tokens", "maxContextTokens")
    )
    """Decode pools: session context the router places on this pool; unset means the nodes' max_model_len."""
    cores: list[int] | None = None
    """CPU core per instance for vLLM on CPU (`VLLM_CPU_OMP_THREADS_BIND`); unset means round-robin."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Node `Settings` fields of every instance (reference engine), e.g. `{num_rows: 512, kv: {ucx_tls: tcp}}`;
    they reach the node as environment with its role's prefix (`PREFILL_NUM_ROWS`, `PREFILL_KV__UCX_TLS`)."""
    gpus: list[int] | None = None
    """With `device: cuda`: the GPU ids of the pool's ranks, `world_size` per instance in instance order (instance
    i: `gpus[i*W:(i+1)*W]`, its CUDA_VISIBLE_DEVICES); unset means the next GPUs in config order."""

    @field_validator("tp", "dcp")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if not _is_power_of_two(value):
            raise ValueError(f"must be a power of two (1, 2, 4, 8, ...), got {value}")
        return value

    @field_validator("ports")
    @classmethod
    def _valid_ports(cls, ports: list[int] | None) -> list[int] | None:
        for port in ports or []:
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} is outside 1..65535")
        return ports

    @model_validator(mode="after")
    def _shape(self) -> "PoolSpec":
        if self.ports is not None and len(self.ports) != self.count:
            raise ValueError(f"pool {self.name!r}: {len(self.ports)} ports for {self.count} instances")
        if self.gpus is not None and len(self.gpus) != self.count * self.world_size:
            raise ValueError(f"pool {self.name!r}: {len(self.gpus)} gpus for {self.count} instances of "
                             f"{self.world_size} ranks (one GPU per rank)")
        for index in range(self.count if self.gpus is not None else 0):
            mine = self.gpus[index * self.world_size:(index + 1) * self.world_size]
            if len(set(mine)) != len(mine) or min(mine) < 0:
                raise ValueError(f"pool {self.name!r}: instance {index} gpus {mine}: distinct GPU ids >= 0 (NCCL "
                                 "refuses two ranks of one group on one GPU)")
        if self.cores is not None and len(self.cores) != self.count:
            raise ValueError(f"pool {self.name!r}: {len(self.cores)} cores for {self.count} instances")
        if self.role == "prefill" and self.max_context_tokens is not None:
            raise ValueError(f"prefill pool {self.name!r}: max_context_tokens applies to decode pools only")
        if self.role == "prefill" and self.dcp != 1:
            raise ValueError(f"prefill pool {self.name!r}: dcp must be 1 (prefill is token-sharded), got {self.dcp}")
        self._check_settings()
        return self

    def _check_settings(self) -> None:
        """The role's Settings accept `settings` (validated without reading this process's environment)."""
        owned = sorted(set(self.settings) & set(POOL_OWNED_SETTINGS))
        if owned:
            raise ValueError(f"pool {self.name!r}: settings.{owned[0]}: set by the pool's own fields (name, model, tp, "
                             "dcp, ports) or the cluster's host, not under settings")
        try:
            node_settings_class(self.role).model_validate(self.settings)
        except ValidationError as exc:
            problems = "; ".join(f"settings.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"pool {self.name!r}: {problems}") from None

    @property
    def world_size(self) -> int:
        """Rank processes (or GPUs) per instance."""
        return max(self.tp, self.dcp)


class RouterSpec(_Strict):
    """The router process."""

    port: int | None = Field(8000, ge=1, le=65535)
    """HTTP port; null means a free port."""
    extra_args: list[str] = Field(default_factory=list, validation_alias=AliasChoices("extra_args", "extraArgs"))
    env: dict[str, str] = Field(default_factory=dict)
    admin_token: str | None = Field(None, validation_alias=AliasChoices("admin_token", "adminToken"))
    """Bearer token for the router's admin endpoints (written into the router config)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Router `Settings` fields (router/settings.py), written to the `router:` section of its config."""
    workers: int = Field(1, ge=1)
    """Router worker processes (`ROUTER_WORKERS`): one by default here, where the engines share the cores
    (`pdcluster router` alone defaults to the cores available; the chart to its CPU request)."""


class VllmSpec(_Strict):
    """How instances of the `vllm` engine start."""

    python: str | None = None
    """Python that has vLLM installed; unset means `.venv-vllm/bin/python` if present, else this one."""
    max_model_len: int = Field(2048, ge=16, validation_alias=AliasChoices("max_model_len", "maxModelLen"))
    served_model_name: str | None = Field(None, validation_alias=AliasChoices("served_model_name", "servedModelName"))
    """Model id clients send; unset means the model directory's name."""
    extra_args: list[str] = Field(default_factory=list, validation_alias=AliasChoices("extra_args", "extraArgs"))
    kvcache_space_gib: int = Field(1, ge=1, validation_alias=AliasChoices("kvcache_space_gib", "kvcacheSpaceGib"))
    """`VLLM_CPU_KVCACHE_SPACE` on CPU."""
    cpu: bool | None = None
    """Run vllm-cpu settings (core binding, KV space); unset means: no NVIDIA GPU visible."""
    nixl_progress_delay_us: int | None = Field(None, ge=0, validation_alias=AliasChoices(
        "nixl_progress_delay_us", "nixlProgressDelayUs"))
    """How long NIXL's UCX progress thread in each vLLM process waits between passes (cluster/vllm_site). NIXL's
    Python API makes it a busy loop, a core per vLLM worker even while idle; unset means 2000 on CPU (the same
    wait as the reference nodes' `kv.progress_delay_us`) and NIXL's own busy loop on GPUs."""


class ClusterConfig(_Strict):
    """A whole cluster: router, pools, model and engine defaults."""

    model: str = DEFAULT_MODEL
    """Reference engine: a preset (`kimi-k3.1-mini`), a ModelConfig JSON file or a checkpoint directory (config.json
    of `kimi_linear`, `deepseek_v32` or `pdcluster_k3`, safetensors, tokenizer files: every pool loads the same
    files); vllm: a model directory."""
    engine: Engine = "reference"
    host: str = "127.0.0.1"
    """Address every process binds to."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    pools: list[PoolSpec]
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    startup_timeout_s: float = Field(300.0, gt=0, validation_alias=AliasChoices("startup_timeout_s", "startupTimeoutS"))
    """Bound on waiting for every process to answer /health."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Reference nodes compute on `cpu` (gloo groups) or `cuda`: one GPU per rank (weights, row pool, NIXL VRAM,
    NCCL groups), spread by cluster/plan.py `assign_gpus`."""
    gpus: int | None = Field(None, ge=1)
    """GPUs on the host for `device: cuda` (`pdcluster up --gpus N`); unset means the GPUs visible at start."""

    @model_validator(mode="after")
    def _pools(self) -> "ClusterConfig":
        names = [pool.name for pool in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique, repeated: {', '.join(duplicates)}")
        roles = {pool.role for pool in self.pools}
        for role in ("prefill", "decode"):
            if role not in roles:
                raise ValueError(f"at least one {role} pool is required, found none")
        for pool in self.pools:
            if self.engine_of(pool) == "vllm" and pool.settings:
                raise ValueError(f"pool {pool.name!r}: settings apply to reference-engine nodes; a vllm pool takes "
                                 "extra_args and env")
            if self.engine_of(pool) == "reference" and pool.tp > 1 and pool.dcp > 1:
                raise ValueError(
                    f"decode pool {pool.name!r}: the reference engine runs TP or DCP, not both (tp={pool.tp}, dcp={pool.dcp})"
                )
        self._check_models()
        self._check_gpus()
        ports = [port for pool in self.pools for port in pool.ports or []]
        if self.router.port is not None:
            ports.append(self.router.port)
        repeated = sorted({port for port in ports if ports.count(port) > 1})
        if repeated:
            raise ValueError(f"ports used more than once: {', '.join(map(str, repeated))}")
        return self

    def _check_models(self) -> None:
        """Every reference pool's model resolves (a preset, a JSON config, a checkpoint directory we can read)."""
        from engine.model.config import resolve_model

        checked: set[str] = set()
        for pool in self.pools:
            model = self.model_of(pool)
            if self.engine_of(pool) != "reference" or model in checked:
                continue
            try:
                resolve_model(model)
            except (ValueError, OSError) as exc:
                raise ValueError(f"pool {pool.name!r}: model {model!r}: {exc}") from None
            checked.add(model)

    def _check_gpus(self) -> None:
        """On cuda, every instance's group fits the host's GPUs (one GPU per rank); explicit ids exist."""
        if self.device != "cuda":
            if any(pool.gpus is not None for pool in self.pools):
                raise ValueError("pool gpus apply with device: cuda")
            return
        for pool in self.pools:
            if self.gpus is not None and pool.world_size > self.gpus:
                raise ValueError(f"pool {pool.name!r}: an instance of {pool.world_size} ranks needs {pool.world_size} "
                                 f"GPUs (NCCL refuses two ranks of one group on one GPU), the host has {self.gpus}; "
                                 "on one GPU run cluster/gpu1.yaml (prefill TP=1, decode TP=1)")
            bad = [g for g in pool.gpus or [] if self.gpus is not None and g >= self.gpus]
            if bad:
                raise ValueError(f"pool {pool.name!r}: gpus {bad} outside 0..{self.gpus - 1}")

    def engine_of(self, pool: PoolSpec) -> Engine:
        return pool.engine or self.engine

    def model_of(self, pool: PoolSpec) -> str:
        return pool.model or self.model

    def pools_by_role(self, role: Role) -> list[PoolSpec]:
        return [pool for pool in self.pools if pool.role == role]


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        loc = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        message = error["msg"].removeprefix("Value error, ")
        got = error.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None or "got " in message else f" (got {got!r})"
        loc = loc or "(top level)"
        lines.append(f"  {loc}: {message}{shown}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>") -> ClusterConfig:
    """Validate a parsed YAML document; raise ConfigError naming every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a cluster config is a mapping with a `pools` list, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid cluster config:\n{_format_errors(exc)}") from None


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))


def with_overrides(
    config: ClusterConfig, *, engine: Engine | None = None, model: str | None = None, router_port: int | None = None,
    device: str | None = None, gpus: int | None = None,
) -> ClusterConfig:
    """The config with command-line overrides applied (validated again)."""
    data = config.model_dump(by_alias=False)
    if device is not None:
        data["device"] = device
    if gpus is not None:
        data["gpus"] = gpus
    if engine is not None:
        data["engine"] = engine
        for pool in data["pools"]:
            pool["engine"] = None
    if model is not None:
        data["model"] = model
        for pool in data["pools"]:
            pool["model"] = None
    if router_port is not None:
        data["router"]["port"] = router_port
    return parse_config(data, "command line")
