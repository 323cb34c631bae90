"""Settings fields both node kinds share (each node subclasses with its own env prefix).

Every field is settable three ways, highest first: a CLI flag (`--num-rows`, `--kv-ucx-tls`), the environment
with the node's prefix (`PREFILL_NUM_ROWS`; a nested field joins its section with `__`: `PREFILL_KV__UCX_TLS`,
`DECODE_KV__TIMEOUT_S`), the default. A cluster config (or Helm values) sets them per pool with
`settings: {num_rows: 512, kv: {ucx_tls: tcp}}`, which cluster/plan.py turns into that environment.

The `engine` section is engine.api's `EngineConfig` itself, handed to the ranks whole (node/runtime.py
`worker_config` completes it with what the node decides: `tp_size`, `dcp_size`, `quarantine_s`), so a field added
to EngineConfig is a node setting with no code here. Its fields keep their flat names everywhere (they are the
names users know): `--max-step-tokens`, `PREFILL_MAX_STEP_TOKENS`, `settings: {max_step_tokens: 64}`,
`NodeSettings(max_step_tokens=64)` fill `engine.max_step_tokens`, as do the nested spellings
(`PREFILL_ENGINE__MAX_STEP_TOKENS`, `settings: {engine: {max_step_tokens: 64}}`; a flat name wins over its
nested spelling in one source). One flat name differs from its field: `max_num_seqs` (vLLM's) is `max_batch`.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import (BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource,
                               SettingsConfigDict)

from engine.api import EngineConfig
from engine.kernels import KernelChoice, interpreter_active, parallelism_of, resolve, triton_installed
from kv_transfer.signing import ClusterSecret
from kv_transfer.ucx_env import KVTransferSettings

ENGINE_RENAMES = {"max_num_seqs": "max_batch"}
"""Flat setting names whose EngineConfig field is named otherwise."""
NODE_DECIDES = frozenset({"tp_size", "dcp_size", "quarantine_s"})
"""EngineConfig fields the node sets itself (from `tp`, the node kind's DCP size, `kv.timeout_s`): not settings."""
NODE_ENGINE_DEFAULTS = {"max_batch": 16}
"""Where a node's default differs from the engine's (a node runs fewer requests per batch)."""
DEVICES = ("cpu", "cuda")
"""A node's `device`: rank r of a `cuda` node binds the node's local GPU r (engine/rank_engine.py)."""


def engine_fields(settings_cls: type[BaseSettings]) -> frozenset[str]:
    """The field names of the settings' `engine` section (EngineConfig's, read off the class: never listed)."""
    return frozenset(f.name for f in dataclasses.fields(settings_cls.model_fields["engine"].annotation))


def nest_engine(values: Any, fields: frozenset[str]) -> Any:
    """Settings values with their flat engine names (`num_rows`, `max_num_seqs`) moved under `engine`."""
    if not isinstance(values, dict):
        return values
    flat = {ENGINE_RENAMES.get(k, k): v for k, v in values.items() if k in fields or k in ENGINE_RENAMES}
    if not flat:
        return values
    nested = values.get("engine") or {}
    if dataclasses.is_dataclass(nested):  # an EngineConfig given whole: what the node decides is not a setting
        nested = {f.name: getattr(nested, f.name) for f in dataclasses.fields(nested) if f.name not in NODE_DECIDES}
    rest = {k: v for k, v in values.items() if k not in fields and k not in ENGINE_RENAMES}
    return {**rest, "engine": {**nested, **flat}}


class _EngineNested(PydanticBaseSettingsSource):
    """A settings source with its flat engine names nested (so sources still merge by their priority)."""

    def __init__(self, settings_cls: type[BaseSettings], values: Any) -> None:
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return nest_engine(self._values(), engine_fields(self.settings_cls))


def _flat_engine_env(settings_cls: type[BaseSettings]) -> dict[str, Any]:
    """`<PREFIX><NAME>` of every flat engine name (`PREFILL_MAX_STEP_TOKENS`), read as the env source reads."""
    env_vars = EnvSettingsSource(settings_cls).env_vars  # lower-cased keys: the settings are case-insensitive
    prefix = settings_cls.model_config.get("env_prefix", "").lower()
    names = (*engine_fields(settings_cls), *ENGINE_RENAMES)
    return {name: env_vars[prefix + name] for name in names if prefix + name in env_vars}


class NodeSettings(BaseSettings):
    """Common node settings; values come from CLI flags or the node's environment prefix."""

    model_config = SettingsConfigDict(env_nested_delimiter="__")

    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    """Host the peers should use to reach this node (kv_transfer_params.remote_host); default `host`."""
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """This instance's engine id (vLLM's remote_engine_id)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel ranks."""
    max_context: int | None = None
    """Longest prompt + output; default: the model's max_context."""
    default_max_tokens: int = Field(default=256, ge=1)
    start_timeout_s: float = Field(default=900.0, gt=0)
    """How long the ranks may take to start (import torch, build the model, register the pool)."""
    step_timeout_s: float = Field(default=300.0, gt=0)
    """A rank that does not answer a step within this long is declared dead."""
    pin_cores: bool = True
    backend: str = "reference"
    """The ranks' engine factory: "reference" (engine/rank_engine.py), or the "module:function" of another with its
    signature (the node tests' toy engine)."""
    transport: bool = True
    """Register the row pool with NIXL (P -> D transfer); off only for a node that never transfers."""
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(**NODE_ENGINE_DEFAULTS))
    """The ranks' engine (engine/api.py `EngineConfig`, every field documented there), by its flat names: `model`
    (also the served model id), `seed` (every node of a cluster must agree), `num_rows` (packed rows per rank),
    `block_size`, `max_num_seqs` (`max_batch`), `prefix_cache` (docs/SESSIONS.md), `max_step_tokens` (chunked
    prefill), `device` (`cpu`, or `cuda`: rank r on the node's local GPU r, row pool in VRAM, NCCL group),
    `kernels` (`auto`, `reference` or `fast`: engine/kernels.py and its table in docs/ARCHITECTURE.md; a `fast`
    the node cannot run refuses the start, naming the reason)."""
    kv: KVTransferSettings = Field(default_factory=KVTransferSettings)
    """KV transfer (NIXL over UCX): transports, timeouts, the NIXL wheel (kv_transfer/ucx_env.py)."""
    # --- hand-off authentication (kv_transfer/signing.py)
    cluster_secret: SecretStr | None = None
    """Key of the HMAC that prefill nodes put on their kv_transfer_params and decode nodes verify (every node of a
    cluster shares it; `pdcluster up` generates one per cluster, the chart reads it from a Secret). Prefer
    `cluster_secret_file`: an environment value is visible to the process owner only, a flag would be in `ps`."""
    cluster_secret_file: Path | None = None
    """A file holding the cluster secret (mode 0600)."""
    require_reader: bool = False
    """Refuse (400) an export request (a P leg; on a TP decode node, a session's move) whose kv_transfer_params name
    no reader (`decode_engine_id`), so every hand-off this node issues can be redeemed by one decode instance only
    (the lease's first-claim rule stops a second reader either way). Our router names one on every leg to our
    nodes (router/readers.py) and the chart turns this on; off by default for callers that speak vLLM's protocol
    without it (`pdcluster up`'s node tests call the nodes directly)."""
    insecure_handoffs: bool = False
    """Run without a cluster secret: a prefill node answers unsigned params and a decode node imports unsigned
    ones (tests and single-user experiments only). Without it, a node with no secret refuses to start."""
    # --- serving surface (node/serving.py)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """A second port that serves only GET /metrics (so a NetworkPolicy can open metrics without the API). The
    API port keeps /metrics too: the router reads load figures there."""
    max_queued_requests: int = Field(default=256, ge=0)
    """Requests that may wait here beyond the `max_num_seqs` the engine runs; past it a new one gets 503 with
    Retry-After."""
    retry_after_s: int = Field(default=1, ge=1)
    """Retry-After (seconds) on every 503 this node sheds."""
    drain_s: float = Field(default=55.0, ge=0)
    """On SIGTERM: stop admitting (503 + Retry-After, /health 503) and let in-flight requests finish for at most this
    long, then exit. Default: the pool pods' terminationGracePeriodSeconds (60) minus 5 s."""
    drain_hand_off_s: float | None = Field(default=None, ge=0)
    """On SIGTERM, requests still running after this many seconds end with a 503 error naming the drain (an error
    event in a stream), which our router answers by moving each to another instance where it continues with
    the same tokens (router/migration.py); the node exits once they are gone. None: they run until done or
    `drain_s` (for a router that does not move requests)."""
    http_limit_concurrency: int = Field(default=1024, ge=1)
    """uvicorn's limit on open connections + tasks (a plain 503 beyond it: the last guard behind the queues)."""
    http_keep_alive_s: float = Field(default=15.0, gt=0)
    """An idle keep-alive connection is closed after this long."""
    http_head_timeout_s: float = Field(default=10.0, gt=0)
    """A connection must deliver each request head (line + headers) within this long of opening, or of the first
    byte of its next head (408 and closed otherwise: a slowloris client holds a connection no longer)."""
    http_max_header_bytes: int = Field(default=65536, ge=1024)
    """Largest request head (line + headers) the HTTP parser buffers (h11's max incomplete event size)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request body; 413 beyond it."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """A request body must arrive completely within this long (a slow body gets 408)."""
    stream_write_timeout_s: float = Field(default=30.0, gt=0)
    """A response chunk the client does not take within this long ends the response (a stalled SSE reader
    releases its request)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any, env_settings: Any,
                                   dotenv_settings: Any, file_secret_settings: Any) -> tuple[Any, ...]:
        """Keywords (flags) first, then the environment: nested (`PREFILL_ENGINE__NUM_ROWS`), then flat
        (`PREFILL_NUM_ROWS`)."""
        return (_EngineNested(settings_cls, init_settings), env_settings,
                _EngineNested(settings_cls, lambda: _flat_engine_env(settings_cls)), dotenv_settings,
                file_secret_settings)

    @model_validator(mode="before")
    @classmethod
    def _engine_section(cls, values: Any) -> Any:
        """Flat engine names into `engine` (a cluster config's `settings` are validated as one dict), the node's
        defaults under it; refuses unknown engine fields and those the node decides."""
        fields = engine_fields(cls)
        values = nest_engine(values, fields)
        engine = values.get("engine") if isinstance(values, dict) else None
        if isinstance(engine, dict):
            unknown = sorted(set(engine) - fields) + sorted(set(engine) & NODE_DECIDES)
            if unknown:
                raise ValueError(f"engine.{unknown[0]}: not a node setting (engine fields: "
                                 f"{', '.join(sorted(fields - NODE_DECIDES))}; tp, dcp and kv.timeout_s set "
                                 "tp_size, dcp_size and quarantine_s)")
            values = {**values, "engine": {**NODE_ENGINE_DEFAULTS, **engine}}
        return values

    @model_validator(mode="after")
    def _model_resolves(self) -> "NodeSettings":
        """`model` names a preset, a ModelConfig JSON file or a checkpoint directory whose config.json we read."""
        from engine.model.config import resolve_model

        try:
            resolve_model(self.engine.model)
        except (ValueError, OSError) as exc:
            raise ValueError(f"model {self.engine.model!r}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _node_device(self) -> "NodeSettings":
        if self.engine.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)} (a cuda node's rank r takes its GPU r), "
                             f"got {self.engine.device!r}")
        return self

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    def resolved_kernels(self, tp_size: int, dcp_size: int = 1) -> KernelChoice:
        """The kernel set this node's ranks will run (`tp_size` ranks; a DCP pool: `dcp_size` = `tp_size`), from
        the kernel registry; raises KernelRefusal (a ValueError) naming the reason when `kernels` is `fast` and
        the node cannot run it."""
        return resolve(self.engine.kernels, parallelism_of(tp_size, dcp_size), self.engine.device, interpreter_active(),
                       has_triton=triton_installed())

    def handoff_secret(self) -> ClusterSecret | None:
        """The cluster secret (from `cluster_secret` or `cluster_secret_file`); None only with `insecure_handoffs`.
        Raises ValueError naming the settings when there is none: a node without it refuses to start."""
        value = self.cluster_secret.get_secret_value() if self.cluster_secret is not None else None
        secret = ClusterSecret.load(value, self.cluster_secret_file)
        if secret is None and not self.insecure_handoffs:
            prefix = self.model_config.get("env_prefix", "")
            raise ValueError(f"no cluster secret: set {prefix}CLUSTER_SECRET_FILE (a 0600 file) or {prefix}CLUSTER_SECRET "
                             "(`pdcluster up` and the chart do), or --insecure-handoffs to trust unsigned hand-offs")
        return secret
