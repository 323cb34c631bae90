"""Decode node settings (env prefix DECODE_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from node.settings import NodeSettings


class Settings(NodeSettings):
    model_config = SettingsConfigDict(env_prefix="DECODE_")

    port: int = 8200
    dcp: int = Field(default=1, ge=1)
    """Decode-context-parallel ranks (the cache is split by token across them); exclusive with tp > 1."""
    pool: str = "default"
    """Decode pool name reported to the router."""
    kv_load_failure_policy: Literal["fail", "recompute"] = "recompute"
    """A failed KV read (the prefill node died or became unreachable, its lease vanished before the READ):
    `recompute` prefills here (the client never sees it), `fail` answers a clean error (rows released
    everywhere; the router then moves the request to another instance, router/migration.py)."""
    prefill_peers: list[str] = Field(default_factory=list)
    """"host:port" of the prefill instances this node reads from (`pdcluster up` sets them; env as JSON). Set, a
    hand-off naming any other engine is refused and the address in the params is never used; empty, the signed
    remote_host/remote_port are used (decode_node/peers.py)."""
    import_queue_depth: int = Field(default=64, ge=0)
    """Imports that may wait for free rows; the next one gets 503 with Retry-After at once."""
    import_queue_wait_s: float = Field(default=10.0, ge=0)
    """Longest wait of a queued import for rows (never past its lease) before 503 with Retry-After."""

    @field_validator("prefill_peers")
    @classmethod
    def _peers(cls, peers: list[str]) -> list[str]:
        from decode_node.peers import parse_peer

        for peer in peers:
            parse_peer(peer)
        return peers

    @property
    def world_size(self) -> int:
        return max(self.tp, self.dcp)
