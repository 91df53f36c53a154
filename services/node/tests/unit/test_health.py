"""Probe hysteresis: states change only after N consecutive results."""

from __future__ import annotations

import pytest

from iop_node.domain.health import Health, HealthTracker, ProbeResult

OK = ProbeResult(ok=True, models=("m",))
FAIL = ProbeResult(ok=False, detail="connection refused")


def test_starts_unknown() -> None:
    tracker = HealthTracker()
    assert tracker.state is Health.UNKNOWN


def test_one_success_makes_a_new_provider_available() -> None:
    tracker = HealthTracker(rise=1, fall=2)
    assert tracker.observe(OK)
    assert tracker.state is Health.AVAILABLE
    assert tracker.models == ("m",)


def test_one_failure_makes_an_unknown_provider_unavailable() -> None:
    tracker = HealthTracker(rise=1, fall=3)
    assert tracker.observe(FAIL)
    assert tracker.state is Health.UNAVAILABLE
    assert tracker.detail == "connection refused"


def test_available_needs_fall_failures_in_a_row() -> None:
    tracker = HealthTracker(rise=1, fall=2)
    tracker.observe(OK)
    assert not tracker.observe(FAIL)
    assert tracker.state is Health.AVAILABLE
    assert not tracker.observe(OK)  # the streak is broken
    assert not tracker.observe(FAIL)
    assert tracker.observe(FAIL)
    assert tracker.state is Health.UNAVAILABLE


def test_unavailable_needs_rise_successes_in_a_row() -> None:
    tracker = HealthTracker(rise=3, fall=1)
    tracker.observe(FAIL)
    tracker.observe(OK)
    tracker.observe(OK)
    tracker.observe(FAIL)
    tracker.observe(OK)
    tracker.observe(OK)
    assert tracker.state is Health.UNAVAILABLE
    assert tracker.observe(OK)
    assert tracker.state is Health.AVAILABLE


def test_a_failed_run_marks_unavailable_at_once() -> None:
    tracker = HealthTracker(rise=1, fall=5)
    tracker.observe(OK)
    assert tracker.mark_unavailable("refused during a run")
    assert tracker.state is Health.UNAVAILABLE
    assert tracker.observe(OK)  # and one good probe brings it back


def test_thresholds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HealthTracker(rise=0)
