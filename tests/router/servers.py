"""Real servers on 127.0.0.1 in background threads (for streaming, timing, raw-socket and disconnect tests): a
router app (create_app) under router/server.py, the one way the router is served (`pdcluster router` runs it),
and the fake nodes' ASGI apps under uvicorn."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from tests.conftest import free_port


@contextmanager
def uvicorn_server(app, ready_path: str | None = "/health", timeout_s: float = 20.0):
    """Serve an ASGI app (a fake node; not the router, whose completion routes only router/server.py serves) on a
    free port; yields the base URL; stops the server on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def router_server(app, timeout_s: float = 20.0, port: int | None = None):
    """Serve a router app (create_app) with router/server.py on `port` (default: a free one); yields the base URL."""
    from router.server import run_server  # noqa: PLC0415

    port = port or free_port()
    loop = asyncio.new_event_loop()
    ready, stop = asyncio.Event(), asyncio.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            loop.run_until_complete(run_server(app, "127.0.0.1", port, stop=stop, ready=ready))
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not ready.is_set():
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"router server did not start: {errors}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=40)


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=5.0)
