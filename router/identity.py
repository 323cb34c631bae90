"""Client identity at the router edge: optional API keys, and session keys scoped per key and hashed.

API keys (`Authorization: Bearer KEY`): configured by `Settings.api_keys` (comma-separated, e.g. the env
`ROUTER_API_KEYS` filled from a Kubernetes Secret) and/or `Settings.api_keys_file` (one key per line, `#`
comments; a Secret mounted as a file). Only SHA-256 digests of the keys are kept; a presented key is hashed
and compared with every configured digest in constant time (`hmac.compare_digest`, no early exit), so
neither timing nor the position of a match leaks. No keys configured: every client is the same anonymous
tenant. With keys: a missing, malformed or unknown key is answered 401 (OpenAI JSON, `invalid_api_key`).

Session ids (`X-Session-ID`, else the body's `user`): at most `MAX_SESSION_ID_BYTES` (128) bytes of UTF-8,
else 400 naming the field. The router never stores or forwards the raw id: `session_key` hashes
(tenant, id) with BLAKE2b to a fixed 32-hex-character key, so two tenants using the same id get different
keys (nobody can steer another key's session) and every table keyed by sessions has fixed-size keys.
Nodes see only that key (`x-pdcluster-session`, docs/SESSIONS.md).

Prefix-cache scope: with keys, every leg carries `x-pdcluster-tenant`, `cache_scope(tenant)` (a BLAKE2b digest of
the tenant id, itself a digest of the key), from which a node salts its prefix cache, so one tenant's cached prefix
is never reused by, nor reported in `cached_tokens` to, another (node/textgen.py `cache_salt`). Without keys every
client is one tenant and the header is not sent. Routing by cache is per session key, which is tenant-scoped too.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.errors import APIError

MAX_SESSION_ID_BYTES = 128
MAX_AUTHORIZATION_BYTES = 1024
"""A longer Authorization header is refused without hashing it (no configured key is that long)."""
MAX_API_KEY_BYTES = 512
ANONYMOUS = "anonymous"
SESSION_KEY_BYTES = 16
"""Session keys are BLAKE2b-128 digests: 32 hex characters (the node contract allows up to 64)."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeys:
    """The configured keys as digests; `tenant(headers)` authenticates a request."""

    def __init__(self, keys: list[str]) -> None:
        for key in keys:
            if not key or len(key.encode()) > MAX_API_KEY_BYTES or any(c.isspace() for c in key):
                raise ValueError(f"API keys must be 1..{MAX_API_KEY_BYTES} bytes without whitespace")
        self._digests = tuple(dict.fromkeys(_digest(k.encode()) for k in keys))

    @classmethod
    def from_settings(cls, inline: str | None, path: str | None) -> APIKeys:
        """Keys from `inline` (comma-separated) and the file at `path` (one per line, `#` comments)."""
        keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
        if path:
            for line in Path(path).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return cls(keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests)

    def tenant(self, authorization: str | None) -> str:
        """The tenant id of a request (hex digest prefix of its key), or ANONYMOUS when no keys are set.

        Raises APIError(401) when keys are configured and the header is missing, malformed or unknown."""
        if not self._digests:
            return ANONYMOUS
        if not authorization:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if len(authorization) > MAX_AUTHORIZATION_BYTES or not authorization[:7].lower() == "bearer ":
            raise _unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        presented = _digest(authorization[7:].strip().encode("latin-1", "replace"))
        found = None
        for digest in self._digests:  # every digest compared: no early exit
            if hmac.compare_digest(presented, digest):
                found = digest
        if found is None:
            raise _unauthorized("incorrect API key provided")
        return found.hex()[:16]


def cache_scope(tenant: str) -> str:
    """The prefix-cache scope the legs name (`x-pdcluster-tenant`): "" for the anonymous tenant, else 32 hex
    characters (neither the key nor the tenant id leaves the router)."""
    if tenant == ANONYMOUS:
        return ""
    return hashlib.blake2b(tenant.encode(), digest_size=16, person=b"pdc-cache-scope").hexdigest()


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, None, "invalid_request_error")


def raw_session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, str]:
    """The client's session id and where it came from (`X-Session-ID` header first, then `user`)."""
    header = headers.get("x-session-id")
    if header:
        return header, "X-Session-ID"
    user = body.get("user")
    if isinstance(user, bool) or user is None or user == "":
        return None, "user"
    if isinstance(user, int):
        return str(user), "user"
    if isinstance(user, str):
        return user, "user"
    raise APIError(400, f"user must be a string, got {type(user).__name__}", "user")


def session_key(tenant: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The hashed, tenant-scoped session key of a request (None: no session). 400 past 128 bytes."""
    raw, source = raw_session_id(headers, body)
    if raw is None:
        return None
    # Header values arrive latin-1 decoded (one char per byte); body strings are measured as UTF-8.
    size = len(raw) if source == "X-Session-ID" else len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_SESSION_ID_BYTES:
        raise APIError(400, f"session id ({source}) is {size} bytes, more than the limit of {MAX_SESSION_ID_BYTES}",
                       source)
    data = f"{tenant}\0{raw}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=SESSION_KEY_BYTES, person=b"pdc-session").hexdigest()
