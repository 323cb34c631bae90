"""Kubernetes discovery: watch pods by label selector in one namespace and keep the registry current.

Pod -> instance mapping (`pod_to_spec`), from labels and annotations the Helm chart sets:
    labels:      pdcluster.io/role = prefill|decode   (required; other pods are ignored)
                 pdcluster.io/pool, pdcluster.io/engine = vllm|reference, pdcluster.io/tp, pdcluster.io/dcp
    annotations: pdcluster.io/port (default 8000), pdcluster.io/block-size, pdcluster.io/model,
                 pdcluster.io/scheme (default http)
Readiness: the pod has an IP, phase Running, condition Ready=True and no deletion timestamp; a not-ready
pod stays in the registry marked not ready (so it turns unhealthy without being probed).
The watch runs in a worker thread (the kubernetes client is synchronous); registry changes are handed to
the event loop with `emit`. A 410 Gone (expired resourceVersion) triggers a fresh list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from router.config import InstanceSpec
from router.registry import Registry

log = logging.getLogger(__name__)
PREFIX = "pdcluster.io/"


def _int(value: Any) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def is_pod_ready(pod: Any) -> bool:
    status, meta = pod.status, pod.metadata
    if status is None or not status.pod_ip or status.phase != "Running" or meta.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


def pod_to_spec(pod: Any) -> InstanceSpec | None:
    """The instance a pod stands for, or None when it is not a pdcluster node."""
    labels = pod.metadata.labels or {}
    notes = pod.metadata.annotations or {}
    role = labels.get(PREFIX + "role")
    if role not in ("prefill", "decode"):
        return None
    engine = labels.get(PREFIX + "engine")
    ip = pod.status.pod_ip if pod.status is not None else None
    port = _int(notes.get(PREFIX + "port")) or 8000
    scheme = notes.get(PREFIX + "scheme", "http")
    return InstanceSpec(
        name=f"{pod.metadata.namespace}/{pod.metadata.name}", role=role,
        url=f"{scheme}://{ip or '0.0.0.0'}:{port}", pool=labels.get(PREFIX + "pool", "default"),
        engine=engine if engine in ("vllm", "reference") else None,
        tp=_int(labels.get(PREFIX + "tp")), dcp=_int(labels.get(PREFIX + "dcp")),
        block_size=_int(notes.get(PREFIX + "block-size")), model=notes.get(PREFIX + "model"),
        ready=is_pod_ready(pod))


class KubeDiscovery:
    def __init__(self, registry: Registry, core_api: Any, namespace: str, label_selector: str,
                 watch_factory: Callable[[], Any] | None = None, timeout_s: int = 60) -> None:
        self.registry = registry
        self.core_api = core_api
        self.namespace = namespace
        self.label_selector = label_selector
        self.timeout_s = timeout_s
        if watch_factory is None:
            from kubernetes import watch  # noqa: PLC0415 - only where discovery runs

            watch_factory = watch.Watch
        self.watch_factory = watch_factory
        self.known: set[str] = set()
        self.resource_version: str | None = None

    def apply_event(self, kind: str, pod: Any) -> None:
        spec = pod_to_spec(pod)
        name = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if kind == "DELETED" or spec is None:
            if name in self.known:
                self.known.discard(name)
                self.registry.remove(name)
            return
        self.known.add(name)
        self.registry.upsert(spec)

    def sync(self, pods: list[Any]) -> None:
        """Make the discovered part of the registry equal to `pods` (after a list)."""
        seen = set()
        for pod in pods:
            self.apply_event("ADDED", pod)
            seen.add(f"{pod.metadata.namespace}/{pod.metadata.name}")
        for name in self.known - seen:
            self.known.discard(name)
            self.registry.remove(name)

    def run_once(self, emit: Callable[[Callable[[], None]], None]) -> None:
        """One list (when needed) plus one watch of up to `timeout_s`; `emit(fn)` applies `fn` to the registry."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        if self.resource_version is None:
            listing = self.core_api.list_namespaced_pod(self.namespace, label_selector=self.label_selector)
            items = list(listing.items)
            emit(lambda: self.sync(items))
            self.resource_version = listing.metadata.resource_version
        watcher = self.watch_factory()
        try:
            for event in watcher.stream(self.core_api.list_namespaced_pod, self.namespace,
                                        label_selector=self.label_selector, resource_version=self.resource_version,
                                        timeout_seconds=self.timeout_s):
                pod, kind = event["object"], event["type"]
                if kind == "ERROR":
                    self.resource_version = None
                    return
                self.resource_version = pod.metadata.resource_version or self.resource_version
                emit(lambda kind=kind, pod=pod: self.apply_event(kind, pod))
        except ApiException as exc:
            if exc.status == 410:
                self.resource_version = None
            else:
                raise
        finally:
            watcher.stop()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def emit(fn: Callable[[], None]) -> None:
            loop.call_soon_threadsafe(fn)

        while True:
            try:
                await asyncio.to_thread(self.run_once, emit)
            except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
                log.warning("kubernetes watch failed: %s", exc)
                self.resource_version = None
                await asyncio.sleep(2.0)


def make_core_api() -> Any:
    """A CoreV1Api from in-cluster config, else the local kubeconfig."""
    from kubernetes import client, config  # noqa: PLC0415

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()
