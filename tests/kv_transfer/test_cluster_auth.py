"""Signed control requests (kv_transfer/cluster_auth.py): what a member of the cluster signs verifies once;
forged, altered, stale and replayed requests are refused, through a real FastAPI app and httpx client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from kv_transfer.cluster_auth import HEADER, AuthRefused, ClusterAuth, ControlGuard, sign_headers
from kv_transfer.signing import ClusterSecret, lease_key
from serving.errors import install_error_handlers

SECRET = ClusterSecret(b"k" * 32)
OTHER = ClusterSecret(b"o" * 32)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_signed_request_verifies_once():
    clock = Clock()
    guard = ControlGuard(SECRET, clock=clock)
    headers = sign_headers(SECRET, "POST", "/abort_requests", b'{"request_ids":["a"]}', now=clock.now)
    guard.verify("POST", "/abort_requests", b'{"request_ids":["a"]}', headers[HEADER])
    with pytest.raises(AuthRefused, match="replay"):
        guard.verify("POST", "/abort_requests", b'{"request_ids":["a"]}', headers[HEADER])


@pytest.mark.parametrize("method,target,body", [
    ("GET", "/abort_requests", b'{"request_ids":["a"]}'),
    ("POST", "/kv/leases/0123/abort", b'{"request_ids":["a"]}'),
    ("POST", "/abort_requests?x=1", b'{"request_ids":["a"]}'),
    ("POST", "/abort_requests", b'{"request_ids":["b"]}'),
], ids=["method", "path", "query", "body"])
def test_altered_request_is_refused(method, target, body):
    clock = Clock()
    guard = ControlGuard(SECRET, clock=clock)
    headers = sign_headers(SECRET, "POST", "/abort_requests", b'{"request_ids":["a"]}', now=clock.now)
    with pytest.raises(AuthRefused, match="does not match"):
        guard.verify(method, target, body, headers[HEADER])


@pytest.mark.parametrize("header", [None, "", "v1:1:2", "v0:1:2:3", "Bearer abc"])
def test_missing_or_malformed_header_is_refused(header):
    with pytest.raises(AuthRefused):
        ControlGuard(SECRET).verify("GET", "/kv/metadata", b"", header)


def test_other_secret_and_stale_timestamps_are_refused():
    clock = Clock()
    guard = ControlGuard(SECRET, window_s=30, clock=clock)
    with pytest.raises(AuthRefused, match="does not match"):
        guard.verify("GET", "/kv/metadata", b"", sign_headers(OTHER, "GET", "/kv/metadata", now=clock.now)[HEADER])
    for skew in (-31.0, 31.0):
        header = sign_headers(SECRET, "GET", "/kv/metadata", now=clock.now + skew)[HEADER]
        with pytest.raises(AuthRefused, match="from this node's clock"):
            guard.verify("GET", "/kv/metadata", b"", header)


def test_nonces_are_forgotten_once_outside_the_window():
    clock = Clock()
    guard = ControlGuard(SECRET, window_s=30, clock=clock)
    for _ in range(5):
        guard.verify("GET", "/v1/cache", b"", sign_headers(SECRET, "GET", "/v1/cache", now=clock.now)[HEADER])
    assert guard.num_remembered == 5
    clock.now += 31
    guard.verify("GET", "/v1/cache", b"", sign_headers(SECRET, "GET", "/v1/cache", now=clock.now)[HEADER])
    assert guard.num_remembered == 1


def test_no_secret_checks_nothing():
    ControlGuard(None).verify("POST", "/abort_requests", b"{}", None)


def test_lease_keys_differ_per_lease_and_secret():
    assert lease_key(SECRET, "a" * 32) != lease_key(SECRET, "b" * 32)
    assert lease_key(SECRET, "a" * 32) != lease_key(OTHER, "a" * 32)


def _app(guard: ControlGuard) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/control", dependencies=[Depends(guard.check)])
    async def control(request: Request) -> dict:
        return await request.json()

    return app


def test_httpx_auth_signs_what_the_fastapi_guard_accepts():
    asyncio.run(_signed_and_unsigned_calls())


async def _signed_and_unsigned_calls() -> None:
    app = _app(ControlGuard(SECRET))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node", auth=ClusterAuth(SECRET)) as client:
        ok = await client.post("/control?verbose=1", json={"request_ids": ["r1"]})
        assert ok.status_code == 200 and ok.json() == {"request_ids": ["r1"]}
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as anonymous:
        refused = await anonymous.post("/control", json={"request_ids": ["r1"]})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    async with httpx.AsyncClient(transport=transport, base_url="http://node", auth=ClusterAuth(OTHER)) as forger:
        assert (await forger.post("/control", json={})).status_code == 401
