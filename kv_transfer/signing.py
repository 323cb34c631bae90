"""Signed hand-offs: the prefill node signs the `kv_transfer_params` it returns, the decode node verifies them.

A decode node reads whatever memory the params name (rows of a pool, on a peer, under a lease), so it must only
act on params a prefill node of its own cluster produced. The prefill node computes an HMAC-SHA256, keyed by the
cluster secret every node shares, over every field that names memory, a peer or a lease (`SIGNED_FIELDS`), and
puts it in the params as `signature` ("v1:<hex>"). The decode node recomputes it and compares in constant time
(`hmac.compare_digest`) before it opens any connection or touches any row; a missing or wrong signature, or a
field altered after signing, is refused.

Canonical form: the JSON of `[SIGNATURE_DOMAIN, [[name, value], ...]]` in `SIGNED_FIELDS` order, values as the
params model dumps them (so a round trip through any JSON codec that keeps floats exact, the router's included,
verifies). A field absent from the params signs as null, so adding or removing one changes the signature.

`ClusterSecret.load(value, path)` reads the secret from a settings value or a file (at least 16 bytes).
`lease_key(secret, lease_id)`: the key of one lease's notifications (kv_transfer/lease.py), derived from the secret,
so the decode node can hand its ranks that key alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from kv_transfer.params import KVTransferParams

SIGNATURE_DOMAIN = "pdcluster-handoff-v1"
LEASE_KEY_DOMAIN = b"pdcluster-lease-notify-v1"
SIGNATURE_PREFIX = "v1:"
MIN_SECRET_BYTES = 16

SIGNED_FIELDS = (
    "do_remote_prefill", "do_remote_decode",
    "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
    "remote_block_ids", "remote_kda_block_ids",
    "tp_size", "dcp_size", "pp_size", "remote_num_tokens", "remote_prefill_cached_tokens",
    "block_size", "subblock_tokens", "layout_fingerprint", "transfer_mode",
    "first_token_id", "first_token_logprob", "first_token_top_logprobs",
    "lease_id", "lease_expiry", "remote_blocks_expiry_time",
    "prompt_digest", "decode_engine_id",
)
"""Every field that names memory (rows, geometry, token count), a peer (engine id, host, port), a lease, the
request, the prompt it belongs to, the decode instance that may redeem it, or what the decode node reports as its
first token."""

LEASE_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
"""A lease id is a uuid4 hex (kv_transfer.lease): nothing else may reach a URL path or a notification."""
ENGINE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class HandoffRefused(ValueError):
    """Params the decode node must not act on; the message says why (it names no secret)."""


@dataclass(frozen=True)
class ClusterSecret:
    """The key every node of a cluster shares (never logged, never sent)."""

    key: bytes

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    @classmethod
    def load(cls, value: str | None, path: Path | None) -> "ClusterSecret | None":
        """The secret from a settings value or a file (trailing newline dropped); None when neither is set."""
        if value is not None and path is not None:
            raise ValueError("set the cluster secret or the cluster secret file, not both")
        if path is not None:
            value = Path(path).read_text().strip()
        if value is None:
            return None
        key = value.encode()
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must have at least {MIN_SECRET_BYTES} bytes, got {len(key)}")
        return cls(key)


def lease_key(secret: ClusterSecret, lease_id: str) -> bytes:
    """The key a lease's notifications are signed with: only members of the cluster can derive it, and it opens
    nothing but that lease's notifications."""
    return hmac.new(secret.key, LEASE_KEY_DOMAIN + b"\n" + lease_id.encode(), hashlib.sha256).digest()


def prompt_digest(prompt_token_ids: list[int] | tuple[int, ...]) -> str:
    """SHA-256 of the prompt's token ids: binds a hand-off to the prompt whose rows it names."""
    return hashlib.sha256(json.dumps(list(prompt_token_ids), separators=(",", ":")).encode()).hexdigest()


def canonical_bytes(params: KVTransferParams) -> bytes:
    """What the signature covers; HandoffRefused if a value has no JSON form (NaN, infinity)."""
    wire = params.model_dump(mode="json")
    fields = [[name, wire.get(name)] for name in SIGNED_FIELDS]
    try:
        return json.dumps([SIGNATURE_DOMAIN, fields], separators=(",", ":"), allow_nan=False).encode()
    except ValueError as exc:
        raise HandoffRefused(f"kv_transfer_params hold a value that cannot be signed: {exc}") from None


def _mac(params: KVTransferParams, secret: ClusterSecret) -> str:
    return hmac.new(secret.key, canonical_bytes(params), hashlib.sha256).hexdigest()


def sign(params: KVTransferParams, secret: ClusterSecret) -> KVTransferParams:
    """A copy of `params` carrying its signature."""
    signed = params.model_copy(update={"signature": None})
    signed.signature = SIGNATURE_PREFIX + _mac(signed, secret)
    return signed


def check_ids(params: KVTransferParams) -> None:
    """Raise HandoffRefused unless the lease id and engine ids have the shapes this cluster issues."""
    if params.lease_id is None or not LEASE_ID_PATTERN.fullmatch(params.lease_id):
        raise HandoffRefused("kv_transfer_params.lease_id is not a lease id")
    if params.remote_engine_id is None or not ENGINE_ID_PATTERN.fullmatch(params.remote_engine_id):
        raise HandoffRefused("kv_transfer_params.remote_engine_id is not an engine id")
    if params.decode_engine_id is not None and not ENGINE_ID_PATTERN.fullmatch(params.decode_engine_id):
        raise HandoffRefused("kv_transfer_params.decode_engine_id is not an engine id")


def verify(params: KVTransferParams, secret: ClusterSecret) -> None:
    """Raise HandoffRefused unless `params` carry a valid signature under `secret` and well-formed ids."""
    given = params.signature
    if not isinstance(given, str) or not given.startswith(SIGNATURE_PREFIX):
        raise HandoffRefused("kv_transfer_params are not signed by a prefill node of this cluster")
    expected = SIGNATURE_PREFIX + _mac(params, secret)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HandoffRefused("kv_transfer_params signature does not match (forged or altered hand-off)")
    check_ids(params)

