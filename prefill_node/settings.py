"""Prefill node settings (env prefix PREFILL_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from node.settings import NodeSettings


class Settings(NodeSettings):
    model_config = SettingsConfigDict(env_prefix="PREFILL_")

    port: int = 8100
    lease_seconds: float = Field(default=30.0, gt=0)
    """How long exported rows wait for their reader (after it, the lease expires and the rows are quarantined
    for `kv.timeout_s`, the read timeout)."""
    lease_sweep_s: float = Field(default=0.25, gt=0)
    token_shard_min_tokens: int = Field(default=1, ge=1)
    """Prefill steps with at least this many tokens use the token-sharded attention, shorter ones the head-sharded
    baseline. Token-sharded logits equal one rank's bit for bit; head-sharded ones differ in the last bits (the
    score GEMM runs on H/W heads), so served log-probs stop matching a teacher-forced pass. Default 1: always
    token-sharded."""
