"""``iop_proto.loop_metrics`` shows on /metrics exactly what prometheus_client's own
Counter, Gauge and Histogram show after the same updates (the ``_created`` times aside)."""

from __future__ import annotations

import math
import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from iop_proto import loop_metrics

_BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def _exposition(registry: CollectorRegistry) -> str:
    text = generate_latest(registry).decode()
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text)


def _exercise(counter, gauge, histogram) -> None:  # type: ignore[no-untyped-def]
    counter.labels("m1", "200").inc()
    counter.labels("m1", "200").inc(2.5)
    counter.labels("m2", "429").inc(0)
    counter.labels("gone", "500").inc()
    counter.remove("gone", "500")
    gauge.labels("m1").set(3)
    gauge.labels("m1").dec()
    gauge.labels("m2").inc(4)
    with gauge.labels("m3").track_inprogress():
        gauge.labels("m3").inc(0)
    with gauge.labels("m4").track_inprogress():
        pass
    for amount in (0.0005, 0.001, 0.0011, 0.5, 10, 11, 1e9, math.nan):
        histogram.labels("m1").observe(amount)
    histogram.labels("m2")  # a series with no observation yet


def _pair(module, registry: CollectorRegistry):  # type: ignore[no-untyped-def]
    return (
        module.Counter("t_requests", "Requests", ["model", "status"], registry=registry),
        module.Gauge("t_in_flight", "In flight", ["model"], registry=registry),
        module.Histogram("t_seconds", "Seconds", ["model"], buckets=_BUCKETS, registry=registry),
    )


def test_exposition_is_prometheus_clients() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    _exercise(*_pair(prometheus_client, theirs))
    _exercise(*_pair(loop_metrics, ours))
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("t_requests_total", {"model": "m1", "status": "200"}) == 3.5
    assert ours.get_sample_value("t_seconds_bucket", {"model": "m1", "le": "+Inf"}) == 7


def test_misuse_fails_as_with_prometheus_client() -> None:
    registry = CollectorRegistry()
    counter, _, _ = _pair(loop_metrics, registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("m1", "200").inc(-1)
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("m1")
    with pytest.raises(KeyError):
        counter.remove("never", "seen")
    with pytest.raises(ValueError, match="Duplicated"):  # the registry refuses a second name
        loop_metrics.Counter("t_requests", "Again", ["model"], registry=registry)
    with pytest.raises(ValueError, match="sorted"):
        loop_metrics.Histogram("t_h", "Unsorted", ["model"], buckets=(1, 0.5), registry=None)
