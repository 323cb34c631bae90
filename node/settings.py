"""Settings fields both node kinds share (each node subclasses with its own env prefix).

Every field is settable three ways, highest first: a CLI flag (`--num-rows`, `--kv-ucx-tls`), the environment
with the node's prefix (`PREFILL_NUM_ROWS`; a nested field joins its section with `__`: `PREFILL_KV__UCX_TLS`,
`DECODE_KV__TIMEOUT_S`), the default. A cluster config (or Helm values) sets them per pool with
`settings: {num_rows: 512, kv: {ucx_tls: tcp}}`, which cluster/plan.py turns into that environment.
"""

from __future__ import annotations

import uuid
from typing import Literal
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.kernels import KernelChoice, interpreter_active, parallelism_of, resolve, triton_installed
from kv_transfer.signing import ClusterSecret
from kv_transfer.ucx_env import KVTransferSettings


class NodeSettings(BaseSettings):
    """Common node settings; values come from CLI flags or the node's environment prefix."""

    model_config = SettingsConfigDict(env_nested_delimiter="__")

    model: str = "kimi-k3.1-mini"
    """Model preset name (engine.model.config presets); also the served model id."""
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    """Host the peers should use to reach this node (kv_transfer_params.remote_host); default `host`."""
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """This instance's engine id (vLLM's remote_engine_id)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel ranks."""
    num_rows: int = Field(default=256, ge=4)
    """Packed rows in each rank's pool."""
    block_size: int | None = None
    """Tokens per attention row; default: the layout planner's smallest legal power of two."""
    max_context: int | None = None
    """Longest prompt + output; default: the model's max_context."""
    default_max_tokens: int = Field(default=256, ge=1)
    max_num_seqs: int = Field(default=16, ge=1)
    start_timeout_s: float = Field(default=900.0, gt=0)
    """How long the ranks may take to start (import torch, build the model, register the pool)."""
    step_timeout_s: float = Field(default=300.0, gt=0)
    """A rank that does not answer a step within this long is declared dead."""
    seed: int | None = None
    """Weights seed of the reference model (default: the engine's; every node of a cluster must agree)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """What the ranks compute on: `cpu` (gloo group), or `cuda`: rank r binds the node's local GPU r
    (CUDA_VISIBLE_DEVICES picks the node's GPUs), builds weights, row pool and intermediates there, NCCL group,
    the pool registered with NIXL as VRAM."""
    kernels: Literal["auto", "reference", "fast"] = "auto"
    """Kernel set of the ranks' engines: `reference` (engine/model/, fp32: served log-probs equal teacher forcing
    bit for bit), `fast` (engine/fast/, bf16 + Triton) or `auto`. What `auto` picks, what runs each phase on a
    TP or DCP node and where `fast` is refused (the node then refuses to start, naming the reason): the kernel
    registry, engine/kernels.py, and its table in docs/ARCHITECTURE.md."""
    pin_cores: bool = True
    backend: str = "reference"
    """Engine backend of the ranks: "reference" (engine/), or "module:function" of another backend factory."""
    transport: bool = True
    """Register the row pool with NIXL (P -> D transfer); off only for a node that never transfers."""
    prefix_cache: bool = True
    """Keep finished KV blocks and reuse the longest cached prefix of a prompt (docs/SESSIONS.md); off: every
    prompt is computed (or read) whole, `cached_tokens` is 0."""
    max_step_tokens: int | None = Field(default=None, ge=1)
    """Chunked prefill: tokens one engine step computes, running decodes first, the rest a chunk of the prompt
    being prefilled (so a long prompt does not stall running streams). None: a prompt prefills in one step."""
    kv: KVTransferSettings = Field(default_factory=KVTransferSettings)
    """KV transfer (NIXL over UCX): transports, timeouts, the NIXL wheel (kv_transfer/ucx_env.py)."""
    # --- hand-off authentication (kv_transfer/signing.py)
    cluster_secret: SecretStr | None = None
    """Key of the HMAC that prefill nodes put on their kv_transfer_params and decode nodes verify (every node of a
    cluster shares it; `pdcluster up` generates one per cluster, the chart reads it from a Secret). Prefer
    `cluster_secret_file`: an environment value is visible to the process owner only, a flag would be in `ps`."""
    cluster_secret_file: Path | None = None
    """A file holding the cluster secret (mode 0600)."""
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
    http_limit_concurrency: int = Field(default=1024, ge=1)
    """uvicorn's limit on open connections + tasks (a plain 503 beyond it: the last guard behind the queues)."""
    http_keep_alive_s: float = Field(default=15.0, gt=0)
    """An idle keep-alive connection is closed after this long."""
    http_max_header_bytes: int = Field(default=65536, ge=1024)
    """Largest request head (line + headers) the HTTP parser buffers (h11's max incomplete event size)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request body; 413 beyond it."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """A request body must arrive completely within this long (a slow body gets 408)."""
    stream_write_timeout_s: float = Field(default=30.0, gt=0)
    """A response chunk the client does not take within this long ends the response (a stalled SSE reader
    releases its request)."""

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    def resolved_kernels(self, tp_size: int, dcp_size: int = 1) -> KernelChoice:
        """The kernel set this node's ranks will run (`tp_size` ranks; a DCP pool: `dcp_size` = `tp_size`), from
        the kernel registry; raises KernelRefusal (a ValueError) naming the reason when `kernels` is `fast` and
        the node cannot run it."""
        return resolve(self.kernels, parallelism_of(tp_size, dcp_size), self.device, interpreter_active(),
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
