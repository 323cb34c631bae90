"""Decode node settings (env prefix DECODE_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from node.settings import NodeSettings


class Settings(NodeSettings):
    model_config = SettingsConfigDict(env_prefix="DECODE_")

    port: int = 8200
    dcp: int = Field(default=1, ge=1)
    """Decode-context-parallel ranks (the cache is split by token across them); exclusive with tp > 1."""
    pool: str = "default"
    """Decode pool name reported to the router."""
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    """A failed KV read: `fail` answers a clean error (rows released everywhere), `recompute` prefills here."""

    @property
    def world_size(self) -> int:
        return max(self.tp, self.dcp)
