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
    """"host:port" of the instances this node reads KV from: the prefill instances, and the other decode instances
    whose streams it may take over on their drain (decode_node/moves.py; `pdcluster up` sets both; env as JSON).
    Set, a hand-off naming any other engine is refused and the address in the params is never used; empty, the
    signed remote_host/remote_port are used (decode_node/peers.py)."""
    move_on_drain: bool = True
    """With `drain_hand_off_s`, hand each running stream that asked for token ids (our router's, which can resume)
    to another decode instance with its KV: the next decode step's token is not streamed, the stream's rows and
    KDA state are leased to the instance the router picks, which READs them and continues (decode_node/moves.py).
    False, or a stream that cannot move (a DCP pool's, a queued one): it ends with a 503 and is recomputed.
    The same leases serve a session that outgrows this TP pool (the router's `do_remote_decode` leg here:
    node/export.py); False: such a leg is refused (400) and the router sends it to a prefill node instead."""
    move_lease_s: float = Field(default=30.0, gt=0)
    """How long a moved stream's rows wait for their reader (then they are quarantined for `kv.timeout_s`)."""
    move_wait_s: float = Field(default=10.0, gt=0)
    """How long the hand-off waits for the streams it moves to reach their next step before it ends the rest with a
    503."""
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
