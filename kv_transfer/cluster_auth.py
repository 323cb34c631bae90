"""Authenticated control messages inside a cluster: HTTP requests between its processes signed with the secret.

Every control route a node serves to other members of its cluster (the prefill node's side channel `/kv/...`,
the nodes' `/abort_requests` and `/v1/cache`) accepts only requests that carry a valid `X-PD-Cluster-Auth`
header. Its value is `v1:<unix seconds>:<nonce>:<hex HMAC-SHA256>`, keyed by the cluster secret
(kv_transfer/signing.py `ClusterSecret`), over the domain, the method, the request target (path and query, as
sent), the timestamp, the nonce and the SHA-256 of the body. The server (`ControlGuard.check`) refuses, with 401
OpenAI error JSON naming no secret, a missing or malformed header, a wrong MAC (forged, or method, target or body
altered), a timestamp outside `window_s` of its own clock, and a nonce it already accepted within the window
(replay). The nonces it keeps are bounded by the window: each is forgotten once its timestamp left it.

Callers: `sign_headers(secret, method, target, body)` for one request, or `ClusterAuth(secret)` as an httpx
`auth=` (sync and async clients; it signs the body httpx sends). The router imports this module too (its
layering allows kv_transfer). A node without a secret (`insecure_handoffs`) checks nothing: it trusts its network.
Lease notifications (NIXL, not HTTP) are authenticated in kv_transfer/lease.py with a per-lease key
(kv_transfer/signing.py `lease_key`), so a decode rank signs its DONE messages without holding the cluster secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator

import httpx
from fastapi import Request

from kv_transfer.signing import ClusterSecret
from serving.errors import APIError

HEADER = "X-PD-Cluster-Auth"
DOMAIN = b"pdcluster-control-v1"
VERSION = "v1"
DEFAULT_WINDOW_S = 30.0
"""How far a request's timestamp may be from the receiver's clock (the nodes' clocks are NTP-synchronised)."""
MAX_NONCES = 1_000_000
"""Nonces remembered at most (about 100 MB of strings in the worst case); past it the oldest go first, which
still refuses every replay older than the oldest kept nonce through the timestamp check's window."""


class AuthRefused(ValueError):
    """A control request that does not prove it comes from a member of the cluster; the message names no secret."""


def _target(raw: bytes | str) -> bytes:
    return raw.encode() if isinstance(raw, str) else raw


def _mac(secret: ClusterSecret, method: str, target: bytes, timestamp: str, nonce: str, body: bytes) -> str:
    message = b"\n".join([DOMAIN, method.upper().encode(), target, timestamp.encode(), nonce.encode(),
                          hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(secret.key, message, hashlib.sha256).hexdigest()


def sign_headers(secret: ClusterSecret, method: str, target: bytes | str, body: bytes = b"",
                 now: float | None = None) -> dict[str, str]:
    """The header that authenticates one request (`target`: path plus `?query` exactly as sent)."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    mac = _mac(secret, method, _target(target), timestamp, nonce, body)
    return {HEADER: f"{VERSION}:{timestamp}:{nonce}:{mac}"}


class ControlGuard:
    """Verifies signed control requests and remembers their nonces for the replay window (thread-safe)."""

    def __init__(self, secret: ClusterSecret | None, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time, max_nonces: int = MAX_NONCES) -> None:
        if window_s <= 0:
            raise ValueError(f"the replay window must be positive, got {window_s}")
        self.secret = secret
        self.window_s = window_s
        self._clock = clock
        self._max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, method: str, target: bytes | str, body: bytes, header: str | None) -> None:
        """Raise AuthRefused unless `header` authenticates this request and was not seen before."""
        if self.secret is None:
            return
        parts = (header or "").split(":")
        if len(parts) != 4 or parts[0] != VERSION:
            raise AuthRefused(f"this route needs a request signed with the cluster secret ({HEADER})")
        _, timestamp, nonce, given = parts
        try:
            sent_at = float(timestamp)
        except ValueError:
            raise AuthRefused(f"{HEADER} has a malformed timestamp") from None
        expected = _mac(self.secret, method, _target(target), timestamp, nonce, body)
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise AuthRefused("the request's cluster signature does not match (forged or altered)")
        now = self._clock()
        if abs(now - sent_at) > self.window_s:
            raise AuthRefused(f"the request was signed {now - sent_at:.0f} s from this node's clock "
                              f"(allowed: {self.window_s:.0f} s)")
        with self._lock:
            self._forget(now)
            if nonce in self._seen:
                raise AuthRefused("the request was already accepted once (replay)")
            self._seen[nonce] = sent_at
            while len(self._seen) > self._max_nonces:
                self._seen.popitem(last=False)

    def _forget(self, now: float) -> None:
        """Drop the oldest nonces whose timestamp left the window (the timestamp check refuses their replays);
        kept in arrival order, so this stops at the first one still inside it."""
        while self._seen:
            nonce, at = next(iter(self._seen.items()))
            if now - at <= self.window_s:
                return
            del self._seen[nonce]

    @property
    def num_remembered(self) -> int:
        with self._lock:
            return len(self._seen)

    async def check(self, request: Request) -> None:
        """The FastAPI form: APIError 401 (OpenAI JSON) unless `request` is signed. Use as a route dependency."""
        if self.secret is None:
            return
        target = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string") or b""
        if query:
            target = target + b"?" + query
        try:
            self.verify(request.method, target, await request.body(), request.headers.get(HEADER))
        except AuthRefused as exc:
            raise APIError(401, str(exc)) from None


class ClusterAuth(httpx.Auth):
    """httpx auth that signs every request with the cluster secret (`httpx.AsyncClient(auth=ClusterAuth(s))`);
    with no secret it sends requests unsigned (an insecure cluster)."""

    requires_request_body = True

    def __init__(self, secret: ClusterSecret | None) -> None:
        self.secret = secret

    def __call__(self, request: httpx.Request) -> httpx.Request:
        """Sign `request` in place (the function-auth form other httpx-compatible clients take)."""
        if self.secret is not None:
            request.headers.update(sign_headers(self.secret, request.method, request.url.raw_path, request.content))
        return request

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        yield self(request)
