"""Admin endpoints (bearer token from `Settings.admin_token`; all refused when it is unset).

GET  /v1/pools                      pools, instances (health, load, geometry, breakers), the P x D matrix
                                    with the reason for every incompatible pair, warm pairs
POST /admin/instances/{name}/drain  stop placing new requests on an instance (in-flight ones finish); applied
                                    by every router replica (router/peers.py)
POST /admin/instances/{name}/undrain
GET  /admin/drains                  names of the drained instances (what a starting replica adopts)
GET  /admin/sessions                session placements
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict

from fastapi import APIRouter, Depends, Request

from router.peers import FORWARDED, broadcast_drain, fetch_drains
from router.state import RouterState
from serving.errors import APIError


def _state(request: Request) -> RouterState:
    return request.app.state.router


def require_admin(request: Request) -> None:
    token = _state(request).settings.admin_token
    if not token:
        raise APIError(403, "admin endpoints are disabled (no admin token configured)", type="permission_error")
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer "):
        raise APIError(401, "missing bearer token", type="authentication_error")
    if not secrets.compare_digest(header[7:].strip().encode(), token.encode()):
        raise APIError(403, "invalid bearer token", type="permission_error")


router = APIRouter(dependencies=[Depends(require_admin)])


def pools_view(state: RouterState) -> dict:
    now = time.monotonic()
    instances = state.registry.snapshot()
    views = state.pool_views(instances)
    inst = []
    for view in instances:
        breaker = state.breakers.instance(view.name)
        raw = state.registry.get(view.name)
        inst.append({"name": view.name, "role": view.role, "url": view.url, "pool": view.pool,
                     "healthy": view.is_healthy, "draining": view.is_draining, "inflight": view.num_inflight,
                     "geometry": asdict(view.geometry), "load": asdict(view.load),
                     "max_model_len": view.max_model_len, "breaker": breaker.state(now),
                     "last_error": raw.last_error if raw else None,
                     "engine_id": state.cache_view.engine_id(view.name)})
    usable = state.usable_pairs(now)
    pairs = [{"prefill": p, "decode": d, "compatible": v.is_compatible, "reasons": list(v.reasons),
              "usable": (p, d) in usable, "warm": (p, d) in state.warm_pairs,
              "link_breaker": state.breakers.link(p, d).state(now)}
             for (p, d), v in sorted(state.registry.matrix.items())]
    return {"pools": [{"name": v.name, "kind": v.kind, "capacity_tokens": v.capacity_tokens,
                       "decodes": [i.name for i in instances if i.role == "decode" and i.pool == v.name]}
                      for v in views],
            "instances": inst, "pairs": pairs}


@router.get("/v1/pools")
async def get_pools(request: Request) -> dict:
    return pools_view(_state(request))


async def apply_drain(state: RouterState, name: str, value: bool) -> None:
    """Drain (or undrain) `name` in this replica: every worker process, and instances discovered later."""
    if value:
        state.registry.drained.add(name)
    else:
        state.registry.drained.discard(name)
    inst = state.registry.get(name)
    if inst is not None:
        inst.is_draining = value
        if value and inst.spec.role == "decode":
            state.sessions.drop_instance(name)
    if state.shared is not None:
        await state.shared.set_draining(name, value)  # every sibling worker applies it before this answers


async def adopt_peer_drains(state: RouterState) -> None:
    """At start-up: take the drains in force on the first peer replica that answers."""
    names = await fetch_drains(state.client, state.settings)
    for name in sorted((names or set()) - state.registry.drained):
        await apply_drain(state, name, True)


async def _set_draining(request: Request, name: str, value: bool) -> dict:
    state = _state(request)
    inst = state.registry.get(name)
    is_forwarded = request.headers.get(FORWARDED) == "1"
    if inst is None and not is_forwarded:
        raise APIError(404, f"no instance named {name!r}", "name")
    await apply_drain(state, name, value)
    answer = {"name": name, "draining": value, "inflight": inst.num_inflight if inst else 0}
    if not is_forwarded and (state.settings.peer_urls or state.settings.peer_dns):
        answer["replicas"] = await broadcast_drain(state.client, state.settings, name, value,
                                                   request.headers.get("authorization", ""))
    return answer


@router.post("/admin/instances/{name:path}/drain")
async def drain(request: Request, name: str) -> dict:
    return await _set_draining(request, name, True)


@router.post("/admin/instances/{name:path}/undrain")
async def undrain(request: Request, name: str) -> dict:
    return await _set_draining(request, name, False)


@router.get("/admin/drains")
async def drains(request: Request) -> dict:
    return {"draining": sorted(_state(request).registry.drained)}


@router.get("/admin/sessions")
async def sessions(request: Request) -> dict:
    return {"sessions": [asdict(r) for r in _state(request).sessions.records()]}
