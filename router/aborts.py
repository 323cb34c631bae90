"""How to abort a request on a node, per engine (pluggable).

- vLLM aborts a request when its HTTP connection closes; the router closes the leg's connection, so
  `CloseConnectionAborter` has nothing more to send. (vLLM has no abort endpoint: P blocks handed off but
  never fetched are freed by the P-side KV lease.)
- Reference nodes expose `POST /abort_requests {"request_ids": [...]}`, which also frees leased rows
  that a fetch never claimed; `AbortRequestsAborter` calls it.
Abort calls are best effort: they never raise.
"""

from __future__ import annotations

from typing import Protocol

import httpx


class Aborter(Protocol):
    async def abort(self, client: httpx.AsyncClient, url: str, request_id: str) -> bool:
        """Ask the node at `url` to drop `request_id`; True when the node confirmed."""


class CloseConnectionAborter:
    async def abort(self, client: httpx.AsyncClient, url: str, request_id: str) -> bool:
        return True


class AbortRequestsAborter:
    def __init__(self, path: str = "/abort_requests", timeout_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    async def abort(self, client: httpx.AsyncClient, url: str, request_id: str) -> bool:
        try:
            resp = await client.post(f"{url}{self.path}", json={"request_ids": [request_id]},
                                     headers={"X-Request-Id": request_id}, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code < 300


def aborter_for(engine: str | None) -> Aborter:
    return AbortRequestsAborter() if engine == "reference" else CloseConnectionAborter()
