"""The router's calls to the nodes' control routes are signed with the cluster secret (kv_transfer/cluster_auth.py):
an abort (`POST /abort_requests` on reference nodes) and the `/v1/cache` polls carry an `X-PD-Cluster-Auth` header
that the nodes' `ControlGuard` accepts, bound to the method, path and body (in process, fake nodes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kv_transfer.cluster_auth import HEADER, AuthRefused, ControlGuard
from kv_transfer.signing import ClusterSecret
from tests.router.fakes import FakeNode, MultiHostTransport
from tests.router.harness import completion, router_harness


def test_aborts_and_cache_polls_are_signed(tmp_path, monkeypatch):
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_text("a-cluster-secret-of-enough-bytes-" * 2)
    guard = ControlGuard(ClusterSecret.load(None, secret_file))
    d0 = FakeNode("d0", "decode", engine_label="reference", delay_s=5.0)
    seen: list[httpx.Request] = []
    forward = MultiHostTransport.handle_async_request

    async def recording(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/abort_requests", "/v1/cache"):
            seen.append(request)
        return await forward(self, request)
    monkeypatch.setattr(MultiHostTransport, "handle_async_request", recording)  # from the first cache poll on

    async def main():
        async with router_harness([d0], specs={"d0": {"engine": "reference"}}, cluster_secret_file=str(secret_file),
                                  decode_timeout_s=0.3, cache_poll_interval_s=0.05) as (client, _):
            assert (await client.post("/v1/completions", json=completion())).status_code >= 500
            for _ in range(200):
                if {r.url.path for r in seen} == {"/abort_requests", "/v1/cache"}:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(main())
    assert {r.url.path for r in seen} == {"/abort_requests", "/v1/cache"}, [r.url.path for r in seen]
    for request in seen:
        guard.verify(request.method, request.url.raw_path, request.content, request.headers.get(HEADER))
    abort = next(r for r in seen if r.url.path == "/abort_requests")
    with pytest.raises(AuthRefused):  # bound to the body: another request id is refused
        ControlGuard(guard.secret).verify("POST", abort.url.raw_path, b'{"request_ids": ["pdc-other"]}',
                                          abort.headers.get(HEADER))
