"""Kubernetes discovery against fake API objects (no cluster here): pod -> instance mapping and the
list + watch loop, including deletes, readiness flips and a 410 Gone relist."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from kubernetes.client.exceptions import ApiException

from router.discovery import KubeDiscovery, pod_to_spec
from router.registry import Registry


def pod(name, role="decode", ready=True, ip="10.0.0.5", labels=None, annotations=None, rv="1", deleting=False):
    all_labels = {"pdcluster.io/role": role, **(labels or {})} if role else dict(labels or {})
    conditions = [NS(type="Ready", status="True" if ready else "False")]
    return NS(metadata=NS(name=name, namespace="ns", labels=all_labels, annotations=annotations or {},
                          resource_version=rv, deletion_timestamp="now" if deleting else None),
              status=NS(pod_ip=ip, phase="Running", conditions=conditions))


def test_pod_to_spec_reads_labels_and_annotations():
    spec = pod_to_spec(pod("d-0", labels={"pdcluster.io/pool": "long", "pdcluster.io/tp": "8",
                                          "pdcluster.io/dcp": "8", "pdcluster.io/engine": "reference"},
                           annotations={"pdcluster.io/port": "9000", "pdcluster.io/block-size": "16384",
                                        "pdcluster.io/model": "kimi"}))
    assert (spec.name, spec.role, spec.url, spec.pool, spec.engine, spec.tp, spec.dcp, spec.block_size,
            spec.model, spec.ready) == ("ns/d-0", "decode", "http://10.0.0.5:9000", "long", "reference", 8, 8,
                                        16384, "kimi", True)


@pytest.mark.parametrize("kwargs,ready", [
    ({}, True), ({"ready": False}, False), ({"ip": None}, False), ({"deleting": True}, False),
], ids=["ready", "not-ready", "no-ip", "terminating"])
def test_readiness(kwargs, ready):
    assert pod_to_spec(pod("x", **kwargs)).ready is ready


def test_pods_without_a_role_are_ignored():
    assert pod_to_spec(pod("x", role=None)) is None
    assert pod_to_spec(pod("x", role="router")) is None


class FakeCoreApi:
    def __init__(self, pods, rv="10"):
        self.pods, self.rv = pods, rv
        self.list_calls = 0

    def list_namespaced_pod(self, namespace, label_selector=None, **kw):
        self.list_calls += 1
        assert namespace == "ns" and label_selector == "sel"
        return NS(items=list(self.pods), metadata=NS(resource_version=self.rv))


class FakeWatch:
    """Replays scripted event batches, one per `stream` call; an exception entry is raised."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def __call__(self):
        return self

    def stream(self, func, namespace, **kwargs):
        self.calls.append(kwargs)
        batch = self.script.pop(0) if self.script else []
        for item in batch:
            if isinstance(item, Exception):
                raise item
            yield item

    def stop(self):
        pass


def test_list_then_watch_keeps_registry_current():
    registry = Registry()
    api = FakeCoreApi([pod("p-0", role="prefill"), pod("d-0")])
    watch = FakeWatch([
        [{"type": "ADDED", "object": pod("d-1", rv="11")},
         {"type": "MODIFIED", "object": pod("d-0", ready=False, rv="12")},
         {"type": "DELETED", "object": pod("p-0", role="prefill", rv="13")}],
        [ApiException(status=410)],
        [],
    ])
    disc = KubeDiscovery(registry, api, "ns", "sel", watch_factory=watch, timeout_s=5)
    emit = lambda fn: fn()  # noqa: E731
    disc.run_once(emit)
    assert registry.names() == ["ns/d-0", "ns/d-1"]
    assert registry.get("ns/d-0").spec.ready is False
    assert watch.calls[0]["resource_version"] == "10" and disc.resource_version == "13"
    disc.run_once(emit)  # 410 Gone: forget the resource version
    assert disc.resource_version is None
    api.pods = [pod("d-1")]
    disc.run_once(emit)  # relist: d-0 vanished while we were not watching
    assert api.list_calls == 2 and registry.names() == ["ns/d-1"]


def test_discovery_leaves_static_instances_alone():
    from router.config import InstanceSpec

    registry = Registry()
    registry.upsert(InstanceSpec(name="static-d", role="decode", url="http://h:1"))
    disc = KubeDiscovery(registry, FakeCoreApi([pod("d-0")]), "ns", "sel", watch_factory=FakeWatch([[]]))
    disc.run_once(lambda fn: fn())
    disc.sync([])
    assert registry.names() == ["static-d"]
