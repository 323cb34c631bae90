"""Settings fields both node kinds share (each node subclasses with its own env prefix).

Every field is settable three ways, highest first: a CLI flag (`--num-rows`, `--kv-ucx-tls`), the environment
with the node's prefix (`PREFILL_NUM_ROWS`; a nested field joins its section with `__`: `PREFILL_KV__UCX_TLS`,
`DECODE_KV__TIMEOUT_S`), the default. A cluster config (or Helm values) sets them per pool with
`settings: {num_rows: 512, kv: {ucx_tls: tcp}}`, which cluster/plan.py turns into that environment.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    pin_cores: bool = True
    backend: str = "reference"
    """Engine backend of the ranks: "reference" (engine/), or "module:function" of another backend factory."""
    transport: bool = True
    """Register the row pool with NIXL (P -> D transfer); off only for a node that never transfers."""
    kv: KVTransferSettings = Field(default_factory=KVTransferSettings)
    """KV transfer (NIXL over UCX): transports, timeouts, the NIXL wheel (kv_transfer/ucx_env.py)."""

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host
