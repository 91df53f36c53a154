"""Labelled Prometheus series for the request path: plain numbers, collected at scrape.

prometheus_client's children guard every update with a lock and two checks, for
scrapes from other threads. Our services update and scrape their metrics on one
event loop (``/metrics`` runs ``generate_latest`` in a handler), so the lock
guards nothing there: here an update adds to a float, and the
exposition is built when ``/metrics`` is read, by prometheus_client's own
``Metric`` and ``generate_latest``. Names, labels, help, the ``_total``,
``_bucket``, ``_count``, ``_sum`` and ``_created`` samples and their values are
what prometheus_client's ``Counter``, ``Gauge`` and ``Histogram`` show.

Only labelled metrics that a request updates live here; the rest stay
prometheus_client's.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _client_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

Child = TypeVar("Child", "CounterChild", "GaugeChild", "HistogramChild")


def _use_created() -> bool:
    # prometheus_client's switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics)
    return bool(getattr(_client_metrics, "_use_created", True))


class CounterChild:
    """One series of a counter."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class GaugeChild:
    """One series of a gauge."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def track_inprogress(self) -> GaugeChild:
        """``with gauge.track_inprogress():`` adds 1 for the block (the child is its own
        context manager: nothing is allocated per use)."""
        return self

    def __enter__(self) -> None:
        self.value += 1

    def __exit__(self, *exc_info: object) -> None:
        self.value -= 1


class HistogramChild:
    """One series of a histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount == amount:  # NaN falls in no bucket, as with prometheus_client
            self.counts[bisect_left(self.bounds, amount)] += 1


class Labelled(Collector, Generic[Child]):
    """A metric family with labels: its children by label values, in creation order."""

    _type = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *labelvalues: object) -> Child:
        """The child of these label values, created (and shown from now on) on first use."""
        if len(labelvalues) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}")
        key = tuple(str(value) for value in labelvalues)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def remove(self, *labelvalues: object) -> None:
        """Drop a series (KeyError when it does not exist, as with prometheus_client)."""
        del self._children[tuple(str(value) for value in labelvalues)]

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, self._type)]

    def collect(self) -> Iterable[Metric]:
        family = Metric(self._name, self._documentation, self._type)
        created = _use_created()
        for key, child in self._children.items():
            self._add_samples(family, dict(zip(self._labelnames, key, strict=True)), child, created)
        return [family]

    def _new_child(self) -> Child:
        raise NotImplementedError

    def _add_samples(
        self, family: Metric, labels: dict[str, str], child: Child, created: bool
    ) -> None:
        raise NotImplementedError


class Counter(Labelled[CounterChild]):
    _type = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _add_samples(
        self, family: Metric, labels: dict[str, str], child: CounterChild, created: bool
    ) -> None:
        family.add_sample(self._name + "_total", labels, child.value)
        if created:
            family.add_sample(self._name + "_created", labels, child.created)


class Gauge(Labelled[GaugeChild]):
    _type = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def _add_samples(
        self, family: Metric, labels: dict[str, str], child: GaugeChild, created: bool
    ) -> None:
        family.add_sample(self._name, labels, child.value)


class Histogram(Labelled[HistogramChild]):
    _type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None,
    ) -> None:
        bounds = [float(bound) for bound in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(bound) for bound in bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _add_samples(
        self, family: Metric, labels: dict[str, str], child: HistogramChild, created: bool
    ) -> None:
        total = 0.0
        for le, count in zip(self._le, child.counts, strict=True):
            total += count
            family.add_sample(self._name + "_bucket", {**labels, "le": le}, total)
        family.add_sample(self._name + "_count", labels, total)
        family.add_sample(self._name + "_sum", labels, child.sum)
        if created:
            family.add_sample(self._name + "_created", labels, child.created)
