"""Router replicas: an admin drain given to one replica is applied by every replica.

Mechanism: broadcast through the replicas' own admin API. The peers of a replica are `peer_urls`
(static) plus, with `peer_dns` (`host:port` of a headless Service, the chart's `<router>-peers`), every
address that name resolves to at the time of the call (so replicas added by scaling are included; a
replica's own address is among them, and applying a drain twice changes nothing).

- `POST /admin/instances/NAME/drain|undrain` on any replica applies it there (and on its sibling worker
  processes, router/shared.py), then sends the same call, with the caller's bearer token and the header
  `x-pdcluster-forwarded: 1` (a forwarded call is applied, never forwarded again), to every peer, and
  answers which peers applied it and which could not be reached.
- A replica that starts asks its peers for the drains in force (`GET /admin/drains`) and adopts the first
  answer, so a restarted replica does not send traffic to a drained instance. Drains of instances it has
  not discovered yet are kept by name (`Registry.drained`) and hold once they appear.
A peer that is down during a broadcast misses it until it restarts (then it adopts the drains); the
answer's `failed` list says so, and the operator can repeat the call.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from urllib.parse import quote

import httpx

from router.settings import Settings

log = logging.getLogger("router")
FORWARDED = "x-pdcluster-forwarded"
TIMEOUT_S = 3.0


async def resolve_peers(settings: Settings) -> list[str]:
    """Base URLs of every peer replica: the static ones, then one per address of `peer_dns`."""
    urls = [u.rstrip("/") for u in settings.peer_urls]
    if settings.peer_dns:
        host, _, port = settings.peer_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning("router peers: cannot resolve %s: %s", settings.peer_dns, exc)
            infos = []
        for family, _, _, _, addr in infos:
            ip = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
            url = f"http://{ip}:{addr[1]}"
            if url not in urls:
                urls.append(url)
    return urls


async def broadcast_drain(client: httpx.AsyncClient, settings: Settings, name: str, value: bool,
                          authorization: str) -> dict:
    """Send one drain/undrain to every peer; {"applied": [urls], "failed": [urls]}."""
    action = "drain" if value else "undrain"
    peers = await resolve_peers(settings)
    headers = {"authorization": authorization, FORWARDED: "1"}

    async def one(url: str) -> bool:
        try:
            resp = await client.post(f"{url}/admin/instances/{quote(name, safe='/')}/{action}", headers=headers,
                                     timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            log.warning("router peers: %s of %s not applied on %s: %s", action, name, url, exc)
            return False
        return resp.status_code in (200, 404)  # 404: that replica does not know the instance (yet)

    results = await asyncio.gather(*(one(url) for url in peers))
    return {"applied": [u for u, ok in zip(peers, results, strict=True) if ok],
            "failed": [u for u, ok in zip(peers, results, strict=True) if not ok]}


async def fetch_drains(client: httpx.AsyncClient, settings: Settings) -> set[str] | None:
    """The drains in force on the first peer that answers (None when no peer answered)."""
    if not settings.admin_token:
        return None
    headers = {"authorization": f"Bearer {settings.admin_token}"}
    for url in await resolve_peers(settings):
        try:
            resp = await client.get(f"{url}/admin/drains", headers=headers, timeout=TIMEOUT_S)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            names = resp.json().get("draining")
            if isinstance(names, list):
                return {str(n) for n in names}
    return None
