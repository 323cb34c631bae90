"""Several router worker processes on one port, and the state they share.

`serve(settings, log_level)` runs the router's server (router/server.py, on uvloop) in this process when
`settings.workers == 1`. With more, a supervisor checks the port is free, creates a shared state
directory, and forks `workers` processes; each binds the port with SO_REUSEPORT (the kernel spreads new
connections over them) and runs its own app. A worker that dies is started again.

The workers share drains, metrics and health news through router/shared.py (which also says what stays
per worker and why that is safe).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time

from router.settings import Settings

log = logging.getLogger("router")
GC_GEN0_THRESHOLD = 20_000


def _check_port_free(host: str, port: int) -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"pdcluster router: cannot listen on {host}:{port}: {exc}") from None
    finally:
        probe.close()


def _serve_one(settings: Settings, log_level: str, sock: socket.socket | None = None) -> None:
    import uvloop  # noqa: PLC0415

    from router.app import create_app  # noqa: PLC0415
    from router.server import run_server  # noqa: PLC0415

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every health, metrics and cache poll at INFO: the router's INFO log is starts, state changes
    # and errors (what an operator reads); those requests show at DEBUG.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(settings)
    # The modules, FastAPI routes and pydantic models loaded by now live as long as the process: frozen, full
    # collections stop walking them (those walks were the 20-30 ms pauses behind p99 latency), and young
    # collections run every GC_GEN0_THRESHOLD allocations instead of 700.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    uvloop.run(run_server(app, settings.host, settings.port, sock))


def _worker_main(settings: Settings, log_level: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.host, settings.port))
    _serve_one(settings, log_level, sock)


def serve(settings: Settings, log_level: str = "info") -> None:
    """Serve the router on `settings.host:port` with `settings.workers` processes (blocks)."""
    if settings.workers <= 1:
        _serve_one(settings, log_level)
        return
    _check_port_free(settings.host, settings.port)
    state_dir = tempfile.mkdtemp(prefix="pdcluster-router-")
    context = multiprocessing.get_context("fork")

    def start(worker_id: int):
        worker = settings.model_copy(update={"worker_id": worker_id, "state_dir": state_dir})
        proc = context.Process(target=_worker_main, args=(worker, log_level), name=f"router-worker-{worker_id}")
        proc.start()
        return proc

    procs = {i: start(i) for i in range(settings.workers)}
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping:
            time.sleep(0.5)
            for worker_id, proc in list(procs.items()):
                if not proc.is_alive() and not stopping:
                    log.warning("router worker %d exited with %s; starting it again", worker_id, proc.exitcode)
                    procs[worker_id] = start(worker_id)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            proc.join(timeout=15)
        shutil.rmtree(state_dir, ignore_errors=True)
