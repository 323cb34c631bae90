"""Several router worker processes on one port, and the state they share.

`serve(settings, log_level)` runs the router's server (router/server.py, on uvloop) in this process when
`settings.workers == 1`. With more, a supervisor checks the port is free, creates a shared state
directory, and forks `workers` processes; each binds the port with SO_REUSEPORT (the kernel spreads new
connections over them) and runs its own app. A worker that dies is started again.

What the workers share, and what they do not (each is a full router with its own event loop):
- drains: `POST /admin/instances/NAME/drain` on any worker writes a marker in the state directory; every
  worker applies the markers within `shared_sync_interval_s` (the answering worker at once).
- metrics: each worker publishes its counters and histograms there every `shared_sync_interval_s`;
  `/metrics` on any worker sums them with its own live values (gauges are the answering worker's).
- per worker: circuit breakers and warm pairs (a failing instance is learnt by each worker from its own
  share of the traffic: up to `workers x breaker_failure_threshold` requests meet it before all stop),
  health checks (each worker probes every instance), and session tables. Sessions stay sticky across
  workers because a session's instance is chosen by rendezvous hashing of its id (placement.py,
  `hash_sessions`); what a worker remembers of a session's context (the growth that moves it to a DCP
  pool) is its own, so a worker that has not seen the session's long turns places it by its request alone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, unquote

from prometheus_client.parser import text_string_to_metric_families

from router.settings import Settings

log = logging.getLogger("router")
SUMMED_TYPES = ("counter", "histogram")


class WorkerShared:
    """One worker's view of the shared state directory."""

    def __init__(self, state_dir: str, worker_id: int) -> None:
        self.root = Path(state_dir)
        self.worker_id = worker_id
        self.drain_dir = self.root / "drain"
        self.metrics_dir = self.root / "metrics"
        for path in (self.drain_dir, self.metrics_dir):
            path.mkdir(parents=True, exist_ok=True)

    def set_draining(self, name: str, value: bool) -> None:
        marker = self.drain_dir / quote(name, safe="")
        if value:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def drained(self) -> set[str]:
        return {unquote(path.name) for path in self.drain_dir.iterdir()}

    def apply_drains(self, state) -> None:
        drained = self.drained()
        for inst in state.registry.states():
            is_draining = inst.spec.name in drained
            if is_draining and not inst.is_draining and inst.spec.role == "decode":
                state.sessions.drop_instance(inst.spec.name)
            inst.is_draining = is_draining

    def publish_metrics(self, text: bytes) -> None:
        target = self.metrics_dir / f"{self.worker_id}.prom"
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(text)
        tmp.replace(target)

    async def run(self, state) -> None:
        while True:
            try:
                self.apply_drains(state)
                self.publish_metrics(state.metrics.render())
            except OSError as exc:
                log.warning("worker %d: shared state sync failed: %s", self.worker_id, exc)
            await asyncio.sleep(state.settings.shared_sync_interval_s)

    def merged_metrics(self, own: bytes) -> bytes:
        """`own` exposition with every other worker's counters and histograms added in."""
        others = [path.read_text() for path in self.metrics_dir.glob("*.prom")
                  if path.stem != str(self.worker_id)]
        return merge_expositions(own.decode(), others).encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


def merge_expositions(own: str, others: list[str]) -> str:
    """Text exposition: `own`'s families, counter and histogram samples summed with `others` (whose
    gauges are ignored); `_created` samples are dropped (they do not add up)."""
    families: dict[str, tuple[str, str, dict[tuple, float]]] = {}
    for i, text in enumerate([own, *others]):
        for family in text_string_to_metric_families(text):
            if i and family.type not in SUMMED_TYPES:
                continue
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, {}))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                samples[key] = samples.get(key, 0.0) + sample.value if family.type in SUMMED_TYPES \
                    else sample.value
    lines = []
    for name, (kind, doc, samples) in families.items():
        exposed = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {exposed} {_escape(doc)}", f"# TYPE {exposed} {kind}"]
        lines += [f"{sample}{_labels(labels)} {value!r}" for (sample, labels), value in samples.items()]
    return "\n".join(lines) + "\n"


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
    uvloop.run(run_server(create_app(settings), settings.host, settings.port, sock))


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
