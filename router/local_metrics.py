"""Counters and histograms for the router's hot path, without prometheus_client's per-update lock.

Each router worker is one asyncio event loop, and every update and every scrape of its series runs on that
loop, so an update needs no lock: a counter child is one float, a histogram child one bucket array found by
bisection (prometheus_client takes a mutex per update and walks the bucket list: about 1 us per counter
increment and 2-3 us per histogram observation on the dev VM, twelve of them per request). The exposition is
the one prometheus_client writes for its own Counter and Histogram (`_total`, `_bucket{le=...}`, `_count`,
`_sum`, `_created`, same label order and number formatting), so dashboards, rules and the workers' text
merge (router/shared.py) see no difference. Not thread-safe by design: never update these from another thread.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # Bucket i counts observations <= bounds[i] (the last bound is +Inf): the first bound >= amount.
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def observe_many(self, amount: float, num: int) -> None:
        """`observe(amount)` `num` times."""
        self.counts[bisect.bisect_left(self.bounds, amount)] += num
        self.sum += amount * num


class _Metric:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def labels(self, *values: object):
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected, got {len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _new_child(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def describe(self) -> list:
        return list(self._families())

    def collect(self) -> Iterator:
        return iter(self._families(with_samples=True))

    def _families(self, with_samples: bool = False) -> list:  # pragma: no cover - overridden
        raise NotImplementedError


class LocalCounter(_Metric):
    """`Counter(name, doc, labelnames, registry=...)` with lock-free children (`name` without `_total`)."""

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _families(self, with_samples: bool = False) -> list:
        total = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        created = GaugeMetricFamily(f"{self._name}_created", self._documentation, labels=self._labelnames)
        if with_samples:
            for key, child in self._children.items():
                total.add_metric(key, child.value)
                created.add_metric(key, child.created)
        return [total, created]


class LocalHistogram(_Metric):
    """`Histogram(name, doc, labelnames, buckets=..., registry=...)` with lock-free children."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _families(self, with_samples: bool = False) -> list:
        hist = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        created = GaugeMetricFamily(f"{self._name}_created", self._documentation, labels=self._labelnames)
        if with_samples:
            les = [floatToGoString(b) for b in self._bounds]
            for key, child in self._children.items():
                cumulative, buckets = 0, []
                for le, count in zip(les, child.counts):
                    cumulative += count
                    buckets.append((le, float(cumulative)))
                hist.add_metric(key, buckets, child.sum)
                created.add_metric(key, child.created)
        return [hist, created]
