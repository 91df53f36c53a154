"""NodeMetrics: cached children write the same series labels() would, and forget drops them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from iop_node.metrics import NodeMetrics


def exposition(registry: CollectorRegistry) -> str:
    """/metrics without the ``_created`` timestamps (they differ between two registries)."""
    lines = generate_latest(registry).decode().splitlines()
    return "\n".join(line for line in lines if "_created" not in line)


def test_a_child_is_the_labels_child_and_is_looked_up_once() -> None:
    metrics = NodeMetrics.create(CollectorRegistry())
    runs = metrics.child(metrics.runs, "p1", "completed", "ok")
    assert runs is metrics.runs.labels("p1", "completed", "ok")
    assert metrics.child(metrics.runs, "p1", "completed", "ok") is runs
    assert metrics.child(metrics.runs, "p1", "failed", "ok") is not runs
    assert metrics.child(metrics.in_flight, "p1") is metrics.in_flight.labels("p1")


def test_series_appear_on_first_use_as_with_labels() -> None:
    cached, plain = CollectorRegistry(), CollectorRegistry()
    a, b = NodeMetrics.create(cached), NodeMetrics.create(plain)
    a.child(a.queue_wait, "p1").observe(0.002)
    a.child(a.tokens, "p1", "prompt").inc(5)
    a.child(a.health, "p1", "available").set(1)
    b.queue_wait.labels("p1").observe(0.002)
    b.tokens.labels("p1", "prompt").inc(5)
    b.health.labels("p1", "available").set(1)
    assert exposition(cached) == exposition(plain)
    assert 'kind="completion"' not in exposition(cached)


def test_forget_removes_the_load_series_and_a_later_write_brings_them_back() -> None:
    registry = CollectorRegistry()
    metrics = NodeMetrics.create(registry)
    metrics.child(metrics.in_flight, "p1").set(2)
    metrics.child(metrics.in_flight, "p2").set(1)
    metrics.child(metrics.runs, "p1", "completed", "ok").inc()

    metrics.forget("p1")
    text = generate_latest(registry).decode()
    assert 'iop_node_provider_in_flight{provider="p1"}' not in text
    assert 'iop_node_provider_in_flight{provider="p2"} 1.0' in text
    assert 'iop_node_runs_total{code="ok",outcome="completed",provider="p1"} 1.0' in text

    # A stale child would write nowhere; the series must come back as labels() would.
    metrics.child(metrics.in_flight, "p1").set(0)
    assert 'iop_node_provider_in_flight{provider="p1"} 0.0' in generate_latest(registry).decode()
    metrics.child(metrics.runs, "p1", "completed", "ok").inc()
    text = generate_latest(registry).decode()
    assert 'iop_node_runs_total{code="ok",outcome="completed",provider="p1"} 2.0' in text
