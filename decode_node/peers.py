"""The decode node's peer directory: where each prefill engine it may read from lives, and its side-channel metadata.

A hand-off names its prefill engine (`remote_engine_id`); the address the node connects to comes from here:
- with `prefill_peers` configured (`pdcluster up` passes the cluster's prefill instances), only from that list:
  the directory asks each configured peer's side channel for its engine id (again when an unknown id shows up,
  at most once per `rescan_s`), and an engine id none of them serves is refused (403) without any connection to
  the address the params name;
- without it (the chart, where prefill pods come and go), from the params' `remote_host`/`remote_port`, which the
  node only reads once their signature verified (kv_transfer/signing.py): a prefill node of this cluster wrote
  them.
Metadata is cached per address and refetched when the engine id differs (the prefill node restarted). Every
request to a side channel is signed with the cluster secret (kv_transfer/cluster_auth.py `ClusterAuth`).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from kv_transfer.cluster_auth import ClusterAuth
from kv_transfer.params import KVTransferParams
from kv_transfer.side_channel import InstanceMetadata, LeaseGrant, fetch_metadata
from kv_transfer.signing import ClusterSecret
from serving.errors import APIError

Address = tuple[str, int]


def parse_peer(text: str) -> Address:
    """"host:port" (an IPv6 host in brackets) -> (host, port); ValueError naming the entry otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prefill peer {text!r} is not host:port")
    return host, int(port)


class PeerDirectory:
    """Prefill instances this decode node reads from (see the module docstring)."""

    def __init__(self, peers: list[str] | None = None, timeout_s: float = 10.0, rescan_s: float = 1.0,
                 secret: ClusterSecret | None = None) -> None:
        self.timeout_s = timeout_s
        self.auth = ClusterAuth(secret)
        """Signs every side-channel request (unsigned only on an insecure node)."""
        self.rescan_s = rescan_s
        self.configured: list[Address] = [parse_peer(p) for p in peers or []]
        self._by_engine: dict[str, Address] = {}
        self._cache: dict[Address, InstanceMetadata] = {}
        self._last_scan = -float("inf")
        self._scan_lock = asyncio.Lock()
        """One scan at a time; a request arriving during a scan waits for its answer."""
        self._client = httpx.AsyncClient(timeout=timeout_s, auth=self.auth)

    async def _fetch(self, address: Address) -> InstanceMetadata:
        info = await asyncio.to_thread(fetch_metadata, address[0], address[1], self.auth, self.timeout_s)
        self._cache[address] = info
        self._by_engine[info.engine_id] = address
        return info

    async def _scan(self) -> None:
        self._last_scan = time.monotonic()
        results = await asyncio.gather(*(self._fetch(a) for a in self.configured), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, (httpx.HTTPError, ValueError)):
                raise result

    async def resolve(self, params: KVTransferParams) -> Address:
        """The address of the prefill engine the (verified) params name; APIError 403 if not a peer of ours."""
        if not self.configured:
            if params.remote_host is None or params.remote_port is None:
                raise APIError(400, "kv_transfer_params: remote_host and remote_port are required",
                               "kv_transfer_params")
            return params.remote_host, params.remote_port
        engine_id = params.remote_engine_id or ""
        if engine_id not in self._by_engine:
            async with self._scan_lock:
                if engine_id not in self._by_engine and time.monotonic() - self._last_scan >= self.rescan_s:
                    await self._scan()
        address = self._by_engine.get(engine_id)
        if address is None:
            raise APIError(403, "kv_transfer_params name a prefill engine that is not one of this node's peers",
                           "kv_transfer_params")
        return address

    async def get(self, address: Address, engine_id: str | None) -> InstanceMetadata:
        """Cached metadata of `address`; refetched when the engine id differs (the prefill node restarted)."""
        info = self._cache.get(address)
        if info is None or info.engine_id != engine_id:
            info = await self._fetch(address)
        return info

    async def claim(self, address: Address, lease_id: str, reader: str) -> LeaseGrant:
        """Redeem the lease at its prefill node before reading (the first claim wins, kv_transfer/lease.py): the
        grant names, per rank, the metadata of the lease's rows. APIError 403 / 409 when P refuses it (issued for
        another reader, already redeemed, ended), 502 when P cannot be asked. `lease_id` was validated as a lease
        id before it reaches this URL."""
        url = f"http://{address[0]}:{address[1]}/kv/leases/{lease_id}/claim"
        try:
            resp = await self._client.post(url, json={"reader": reader})
        except httpx.HTTPError as exc:
            raise APIError(502, f"cannot reach the prefill node's side channel to claim the hand-off: "
                                f"{type(exc).__name__}") from None
        if resp.status_code == 200:
            try:
                return LeaseGrant.model_validate(resp.json())
            except ValueError:
                raise APIError(502, "the prefill node's lease grant is malformed") from None
        try:
            reason = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = f"HTTP {resp.status_code}"
        status = 409 if resp.status_code == 409 else 403 if resp.status_code in (401, 403, 404) else 502
        raise APIError(status, f"the prefill node refused the hand-off: {reason}", "kv_transfer_params")

    async def release(self, address: Address, lease_id: str | None, reader: str) -> None:
        """Best effort: tell the prefill node that `reader` (this node, which claimed the lease) will not read (the
        lease would expire anyway). `lease_id` was validated as a lease id (kv_transfer.signing.check_ids) before
        it reaches this URL."""
        if lease_id is None:
            return
        try:
            await self._client.post(f"http://{address[0]}:{address[1]}/kv/leases/{lease_id}/abort",
                                    json={"reader": reader})
        except httpx.HTTPError:
            pass

    async def close(self) -> None:
        await self._client.aclose()
