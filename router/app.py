"""The router's FastAPI app: `create_app(settings) -> FastAPI`, served by router/server.py (production and tests).

Public: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models, GET /health
(readiness: 503 without a usable decode instance), GET /livez (liveness), GET /metrics. Admin (bearer
token): see router/admin.py. The two completion routes are the hot path: the server hands them to
`router/service.py` `serve` without ASGI, so they are no FastAPI routes; every other route is plain FastAPI.
The lifespan builds the RouterState (registry from the YAML config or the quick-start URLs, the
upstream pool for the legs, an httpx client for health checks and aborts), runs one health round, then
keeps health checking, worker-shared state syncing and, when configured, Kubernetes discovery running.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kv_transfer.cluster_auth import ClusterAuth
from kv_transfer.signing import ClusterSecret
from router import admin
from router.cache_view import CachePoller
from router.config import RouterConfig, load_config, quick_start_config
from router.discovery import KubeDiscovery, make_core_api
from router.health import HealthChecker
from router.metrics import CONTENT_TYPE
from router.settings import Settings
from router.state import RouterState
from router.upstream import HttpxUpstream, UpstreamPool
from router.shared import WorkerShared
from serving.errors import APIError, install_error_handlers


def resolve_config(settings: Settings) -> tuple[Settings, RouterConfig]:
    """The config file (or quick-start URLs), with its `router:` section under explicit settings."""
    if settings.config_file:
        config = load_config(settings.config_file)
    else:
        config = quick_start_config(settings.prefill_urls, settings.decode_urls, settings.engine)
    if config.router:
        explicit = settings.model_dump(exclude_unset=True)
        settings = Settings(**{**config.router, **explicit})
    return settings, config


def create_app(settings: Settings | None = None, *, config: RouterConfig | None = None,
               transport: httpx.AsyncBaseTransport | None = None, kube_api: object | None = None) -> FastAPI:
    """`transport` replaces the network for in-process tests; `kube_api` replaces the CoreV1Api."""
    settings = settings or Settings()
    if config is None:
        settings, config = resolve_config(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(None, connect=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        auth = ClusterAuth(ClusterSecret.load(None, settings.cluster_secret_file))  # signs node control calls
        async with httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits, auth=auth) as client:
            upstream = UpstreamPool(settings.connect_timeout_s,
                                    max_connections_per_origin=settings.upstream_max_connections) \
                if transport is None else HttpxUpstream(client)
            shared = WorkerShared(settings.state_dir, settings.worker_id) if settings.state_dir else None
            state = RouterState(settings=settings, config=config, client=client, upstream=upstream, shared=shared)
            app.state.router = state
            checker = HealthChecker(state.registry, client, interval_s=settings.health_interval_s,
                                    timeout_s=settings.health_timeout_s,
                                    unhealthy_threshold=settings.unhealthy_threshold,
                                    healthy_threshold=settings.healthy_threshold,
                                    facts_interval_s=settings.facts_interval_s)
            app.state.health_checker = checker
            checker.on_recovered = state.breakers.recovered
            if shared is not None:
                checker.on_change = lambda: shared.tell_siblings(b"health")
            await checker.check_all()
            tasks = [asyncio.create_task(checker.run())]
            if settings.peer_urls or settings.peer_dns:
                tasks.append(asyncio.create_task(admin.adopt_peer_drains(state)))  # router/peers.py
            poller = CachePoller(state.registry, state.cache_view, client, settings.cache_poll_interval_s,
                                 settings.cache_poll_timeout_s)
            tasks.append(asyncio.create_task(poller.run()))  # what nodes hold per session (docs/SESSIONS.md)
            if state.shared is not None:
                tasks.append(asyncio.create_task(state.shared.run(state, checker)))
            kube = config.kubernetes
            if kube is not None or settings.kube_namespace:
                namespace = kube.namespace if kube else settings.kube_namespace
                selector = kube.label_selector if kube else settings.kube_label_selector
                discovery = KubeDiscovery(state.registry, kube_api or make_core_api(), namespace, selector,
                                          timeout_s=settings.kube_watch_timeout_s)
                tasks.append(asyncio.create_task(discovery.run()))
            try:
                yield
            finally:
                state.deadlines.close()
                if isinstance(upstream, UpstreamPool):
                    upstream.close()
                for task in tasks + list(state.background):
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    app = FastAPI(title="pdcluster router", lifespan=lifespan)
    install_error_handlers(app, catch_all=False)  # router/server.py's dispatch is the one catch-all
    app.include_router(admin.router)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        request.app.state.router.api_keys.tenant(request.headers.get("authorization"))  # 401 when keys are set
        return {"object": "list", "data": request.app.state.router.registry.served_models()}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: RouterState = request.app.state.router
        usable = [s.spec.name for s in state.registry.states()
                  if s.spec.role == "decode" and s.is_healthy and not s.is_draining]
        if not usable:
            raise APIError(503, "no healthy decode instance")
        return JSONResponse({"status": "ok", "decode_instances": usable})

    @app.get("/livez")
    async def livez() -> dict:
        """Liveness: the process serves HTTP (readiness, /health, also needs a healthy decode)."""
        return {"status": "alive"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: RouterState = request.app.state.router
        state.refresh_gauges()
        text = state.metrics.render()
        if state.shared is not None:
            text = await state.shared.merged_metrics(text)
        return Response(text, media_type=CONTENT_TYPE)

    return app
