"""State the worker processes of one router share (router/workers.py starts them), through a directory.

Each worker listens on `STATE_DIR/w<ID>.sock` for one-line commands from its siblings:
`metrics` (answers its exposition), `drains` (re-read the drain markers now), `health` (probe every
instance now). On top of that:
- drains: `POST /admin/instances/NAME/drain` on any worker writes a marker file (the record a restarted
  worker reads) and tells every sibling before it answers, so the drain holds on every worker at once.
- metrics: `/metrics` on any worker asks every sibling for its counters and histograms and sums them with
  its own (gauges are the answering worker's own view, except the per-pool in-flight gauges, which add
  up). A sibling that does not answer within a second (restarting) counts with the snapshot it last
  published (every `shared_sync_interval_s`).
- health: each worker probes every instance; one that sees an instance change health or facts tells the
  siblings, which probe at once, so the workers agree within one probe instead of one interval.
Per worker, by design: Kubernetes discovery (each worker watches the pods: N watches on the API server),
circuit breakers and warm pairs (each learns a failing instance from its own share
of the traffic: up to `workers x breaker_failure_threshold` requests meet it before all stop), and session
tables. Sessions stay sticky across workers because a session's instance is chosen by rendezvous hashing
of its id (placement.py, `hash_sessions`); what a worker remembers of a session's context (the growth
that moves it to a DCP pool) is its own, so a worker that has not seen a session's long turns places it
by its request alone (agent requests carry their history, so the projection is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from urllib.parse import quote, unquote

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("router")
SUMMED_TYPES = ("counter", "histogram")
SUMMED_GAUGES = ("pdcluster_pool_inflight_requests", "pdcluster_pool_inflight_limit")
"""Gauges whose worker values add up to the replica's (each worker admits its own share)."""
ASK_TIMEOUT_S = 1.0


class WorkerShared:
    """One worker's side of the shared state directory."""

    def __init__(self, state_dir: str, worker_id: int) -> None:
        self.root = Path(state_dir)
        self.worker_id = worker_id
        self.drain_dir = self.root / "drain"
        self.metrics_dir = self.root / "metrics"
        for path in (self.drain_dir, self.metrics_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.root / f"w{worker_id}.sock"
        self._state = None
        self._checker = None

    # drains
    async def set_draining(self, name: str, value: bool) -> None:
        marker = self.drain_dir / quote(name, safe="")
        if value:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)
        await self.tell_siblings(b"drains")

    def drained(self) -> set[str]:
        return {unquote(path.name) for path in self.drain_dir.iterdir()}

    def apply_drains(self, state) -> None:
        drained = self.drained()
        state.registry.drained = set(drained)
        for inst in state.registry.states():
            is_draining = inst.spec.name in drained
            if is_draining and not inst.is_draining and inst.spec.role == "decode":
                state.sessions.drop_instance(inst.spec.name)
            inst.is_draining = is_draining

    # metrics
    def publish_metrics(self, text: bytes) -> None:
        target = self.metrics_dir / f"{self.worker_id}.prom"
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(text)
        tmp.replace(target)

    async def merged_metrics(self, own: bytes) -> bytes:
        """`own` exposition with every sibling's counters and histograms added in."""
        siblings = self.siblings()
        answers = await asyncio.gather(*(self.ask(path, b"metrics") for path in siblings))
        others = []
        for path, answer in zip(siblings, answers, strict=True):
            if answer is None:
                snapshot = self.metrics_dir / f"{path.stem[1:]}.prom"
                answer = snapshot.read_bytes() if snapshot.exists() else b""
            others.append(answer.decode())
        return merge_expositions(own.decode(), others).encode()

    # siblings
    def siblings(self) -> list[Path]:
        return sorted(p for p in self.root.glob("w*.sock") if p != self.socket_path)

    async def ask(self, path: Path, command: bytes) -> bytes | None:
        """Send one command to a sibling; its answer, or None when it did not answer in time."""
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(command + b"\n")
                answer = await reader.read()
                writer.close()
                return answer
        except (OSError, TimeoutError):
            return None

    async def tell_siblings(self, command: bytes) -> None:
        await asyncio.gather(*(self.ask(path, command) for path in self.siblings()))

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            command = (await reader.readline()).strip()
            if command == b"metrics":
                self._state.admission.publish()
                writer.write(self._state.metrics.render())
            elif command == b"drains":
                self.apply_drains(self._state)
            elif command == b"health" and self._checker is not None:
                self._state.spawn(self._checker.check_all(notify=False))
            await writer.drain()
        finally:
            writer.close()

    async def run(self, state, checker=None) -> None:
        """Serve the siblings' commands and publish this worker's snapshot until cancelled."""
        self._state, self._checker = state, checker
        self.socket_path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._answer, path=str(self.socket_path))
        try:
            while True:
                try:
                    self.apply_drains(state)
                    state.admission.publish()
                    self.publish_metrics(state.metrics.render())
                except OSError as exc:
                    log.warning("worker %d: shared state sync failed: %s", self.worker_id, exc)
                await asyncio.sleep(state.settings.shared_sync_interval_s)
        finally:
            server.close()
            with contextlib.suppress(OSError):
                self.socket_path.unlink()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


def merge_expositions(own: str, others: list[str]) -> str:
    """Text exposition: `own`'s families, counter and histogram samples summed with `others` (whose
    gauges are ignored, except SUMMED_GAUGES); `_created` samples are dropped (they do not add up)."""
    families: dict[str, tuple[str, str, dict[tuple, float]]] = {}
    for i, text in enumerate([own, *others]):
        for family in text_string_to_metric_families(text):
            summed = family.type in SUMMED_TYPES or family.name in SUMMED_GAUGES
            if i and not summed:
                continue
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, {}))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                samples[key] = samples.get(key, 0.0) + sample.value if summed else sample.value
    lines = []
    for name, (kind, doc, samples) in families.items():
        exposed = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {exposed} {_escape(doc)}", f"# TYPE {exposed} {kind}"]
        lines += [f"{sample}{_labels(labels)} {value!r}" for (sample, labels), value in samples.items()]
    return "\n".join(lines) + "\n"
