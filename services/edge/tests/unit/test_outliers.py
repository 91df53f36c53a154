"""Outlier ejection: what counts against a provider, the closed / ejected / half-open
states, the cap on a model's providers ejected at once, and the slot's place in selection
through them (domain/outliers.py)."""

from __future__ import annotations

import pytest

from iop_edge.domain.events import Completed, ErrorCode, Failed
from iop_edge.domain.faults import counts_against_provider
from iop_edge.domain.outliers import OutlierPolicy, OutlierState, Phase, may_eject
from iop_edge.domain.pool import AVAILABLE, ModelIndex, ProviderSlot, select

POLICY = OutlierPolicy(consecutive_failures=3, cooldown_s=10.0, max_cooldown_s=25.0)
FIVE_HUNDRED = Failed(ErrorCode.PROVIDER_ERROR, "boom", provider_status=500)
DONE = Completed(finish_reason="stop")


@pytest.mark.parametrize(
    ("failed", "counts"),
    [
        (Failed(ErrorCode.PROVIDER_UNAVAILABLE, "refused"), True),
        (Failed(ErrorCode.PROVIDER_TIMEOUT, "too slow"), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "500", provider_status=500), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "503", provider_status=503), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "malformed answer"), True),  # no HTTP status
        (Failed(ErrorCode.PROVIDER_ERROR, "429", provider_status=429), False),
        (Failed(ErrorCode.PROVIDER_ERROR, "404", provider_status=404), False),
        (Failed(ErrorCode.INVALID_REQUEST, "bad"), False),
        (Failed(ErrorCode.NOT_FOUND, "no such model"), False),
        (Failed(ErrorCode.CANCELLED, "client gone"), False),
        (Failed(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline"), False),
        (Failed(ErrorCode.QUEUE_FULL, "node queue"), False),
        (Failed(ErrorCode.QUEUE_TIMEOUT, "node queue"), False),
        (Failed(ErrorCode.INTERNAL, "node bug"), False),
    ],
)
def test_what_counts_against_a_provider(failed: Failed, counts: bool) -> None:
    assert counts_against_provider(failed) is counts


def test_failures_in_a_row_eject_for_the_cooldown() -> None:
    state = OutlierState()
    assert not state.record(FIVE_HUNDRED, 100.0, POLICY)
    assert not state.record(FIVE_HUNDRED, 101.0, POLICY)
    assert state.consecutive_failures == 2
    assert state.record(FIVE_HUNDRED, 102.0, POLICY)
    assert (state.phase, state.until, state.ejections) == (Phase.EJECTED, 112.0, 1)


def test_a_completed_run_resets_the_count_and_neutral_ends_change_nothing() -> None:
    state = OutlierState()
    state.record(FIVE_HUNDRED, 0.0, POLICY)
    state.record(FIVE_HUNDRED, 0.0, POLICY)
    for neutral in (Failed(ErrorCode.CANCELLED, "gone"), Failed(ErrorCode.QUEUE_FULL), None):
        assert not state.record(neutral, 0.0, POLICY)
    assert state.consecutive_failures == 2  # neither counted nor reset
    state.record(DONE, 0.0, POLICY)
    assert state.consecutive_failures == 0
    state.record(FIVE_HUNDRED, 0.0, POLICY)
    state.record(FIVE_HUNDRED, 0.0, POLICY)
    assert state.phase is Phase.CLOSED  # 2 in a row again, not 4


def test_outcomes_while_ejected_change_nothing() -> None:
    state = OutlierState()
    for _ in range(3):
        state.record(FIVE_HUNDRED, 0.0, POLICY)
    assert not state.record(DONE, 1.0, POLICY)  # a run from before the ejection
    assert not state.record(FIVE_HUNDRED, 1.0, POLICY)
    assert (state.phase, state.until, state.consecutive_failures) == (Phase.EJECTED, 10.0, 3)


def test_a_failed_trial_ejects_again_for_longer_up_to_the_cap() -> None:
    state = OutlierState()
    for _ in range(3):
        state.record(FIVE_HUNDRED, 0.0, POLICY)
    lengths = []
    for now in (100.0, 200.0, 300.0):
        assert state.end_cooldown()
        assert (state.phase, state.until) == (Phase.HALF_OPEN, 0.0)
        assert not state.record(Failed(ErrorCode.CANCELLED), now, POLICY)  # no verdict
        assert state.record(FIVE_HUNDRED, now, POLICY)  # one failure is enough on trial
        lengths.append(state.until - now)
    assert lengths == [20.0, 25.0, 25.0]  # 2 x 10, then the 25 s cap
    assert state.ejections == 4


def test_a_successful_trial_closes_and_resets() -> None:
    state = OutlierState()
    for _ in range(3):
        state.record(FIVE_HUNDRED, 0.0, POLICY)
    state.end_cooldown()
    assert state.record(DONE, 11.0, POLICY)
    assert (state.phase, state.consecutive_failures, state.ejections) == (Phase.CLOSED, 0, 0)
    assert not state.end_cooldown()  # a late timer changes nothing


def test_off_never_ejects() -> None:
    state = OutlierState()
    for _ in range(50):
        assert not state.record(FIVE_HUNDRED, 0.0, OutlierPolicy(consecutive_failures=0))
    assert state.phase is Phase.CLOSED


# ------------------------------------------------------------ the slot in selection


def slot(name: str, capacity: int = 4) -> ProviderSlot:
    return ProviderSlot(name, "node", capacity=capacity, health=AVAILABLE, connected=True)


def eject(target: ProviderSlot) -> None:
    for _ in range(POLICY.consecutive_failures):
        target.record_outcome(FIVE_HUNDRED, 0.0, POLICY)
    assert target.outlier.phase is Phase.EJECTED


def test_an_ejected_provider_leaves_selection_and_a_trial_takes_one_run() -> None:
    flaky, steady = slot("flaky"), slot("steady")
    index = ModelIndex("m", [flaky, steady])
    assert index.select() is flaky  # listed first
    eject(flaky)
    assert not flaky.usable
    assert index.select() is steady
    assert index.usable_count == 1

    assert flaky.end_ejection()
    assert index.select() is flaky  # on trial, idle: first again
    flaky.take()  # the trial
    assert flaky.usable
    assert not flaky.has_free_slot  # one run at a time while on trial
    assert index.select() is steady is select([flaky, steady])
    flaky.record_outcome(DONE, 5.0, POLICY)
    assert flaky.has_free_slot  # closed: its whole capacity again, the trial still running
    assert index.select() is steady  # 0/4 beats the trial's 1/4
    flaky.release()
    assert index.select() is flaky


def test_an_ejected_sole_provider_leaves_its_model_without_candidates() -> None:
    only = slot("only")
    index = ModelIndex("m", [only])
    eject(only)
    assert index.select() is None
    assert not index.any_usable  # a request gets a 503 at once, not a wait
    only.end_ejection()
    assert index.any_usable


def test_runs_from_before_the_ejection_hold_back_the_trial() -> None:
    busy = slot("busy")
    index = ModelIndex("m", [busy])
    busy.take()
    busy.take()
    eject(busy)
    busy.end_ejection()
    assert index.select() is None  # on trial, and runs of ours are still on it
    busy.release()
    busy.release()
    assert index.select() is busy


def test_a_drill_s_failures_never_eject() -> None:
    state = OutlierState()
    for _ in range(10):
        assert not state.record(FIVE_HUNDRED, 0.0, POLICY, drill=True)
    assert (state.phase, state.consecutive_failures) == (Phase.CLOSED, 0)


# ------------------------------------------------------------ max_ejection_percent


@pytest.mark.parametrize(
    ("ejected", "members", "percent", "allowed"),
    [
        (0, 1, 10, True),  # the first is always allowed: a sole provider still ejects
        (0, 2, 0, True),
        (1, 2, 10, False),
        (1, 2, 100, True),
        (1, 4, 50, True),  # 2 of 4: 50 %
        (2, 4, 50, False),  # 3 of 4 would be 75 %
        (1, 20, 10, True),  # 2 of 20
        (2, 20, 10, False),
        (1, 19, 10, False),  # 2 of 19 is past 10 %
    ],
)
def test_the_cap_on_a_model_s_providers_ejected_at_once(
    ejected: int, members: int, percent: float, allowed: bool
) -> None:
    assert may_eject(ejected, members, percent) is allowed


def fail_all(slots: list[ProviderSlot], times: int, policy: OutlierPolicy) -> None:
    for _ in range(times):
        for each in slots:
            each.record_outcome(FIVE_HUNDRED, 0.0, policy)


def ejected(slots: list[ProviderSlot]) -> list[str]:
    return [s.provider_id for s in slots if s.outlier.phase is Phase.EJECTED]


def test_every_provider_failing_leaves_the_capped_share_in_selection() -> None:
    policy = OutlierPolicy(3, 10.0, 25.0, max_ejection_percent=50)
    slots = [slot(f"p{i}") for i in range(4)]
    index = ModelIndex("m", slots)
    fail_all(slots, 10, policy)
    assert ejected(slots) == ["p0", "p1"]  # the first two to reach the threshold
    assert index.usable_count == 2
    assert [s.outlier.consecutive_failures for s in slots[2:]] == [10, 10]  # still counting
    # p0's cooldown ends: on trial it is in selection, so one more may go
    assert slots[0].end_ejection()
    assert slots[2].record_outcome(FIVE_HUNDRED, 1.0, policy)  # its next failure ejects it
    assert ejected(slots) == ["p1", "p2"]
    # p0 fails its trial: the cap holds it in selection, still on trial
    assert not slots[0].record_outcome(FIVE_HUNDRED, 2.0, policy)
    assert slots[0].outlier.phase is Phase.HALF_OPEN
    assert index.usable_count == 2


def test_at_the_default_a_pool_of_two_keeps_one() -> None:
    policy = OutlierPolicy(3, 10.0, 25.0)  # 10 %: the first ejection only
    pair = [slot("a"), slot("b")]
    index = ModelIndex("m", pair)
    fail_all(pair, 5, policy)
    assert ejected(pair) == ["a"]
    assert index.select() is pair[1]  # its requests still reach a provider: 502s, not 503s


def test_the_cap_holds_in_every_model_a_provider_serves() -> None:
    policy = OutlierPolicy(1, 10.0, 25.0, max_ejection_percent=50)
    shared, other, alone = slot("shared"), slot("other"), slot("alone")
    ModelIndex("pair", [shared, other])
    ModelIndex("trio", [shared, alone, slot("spare")])
    assert other.record_outcome(FIVE_HUNDRED, 0.0, policy)
    assert not shared.ejection_allowed(50)  # "pair" would have none left
    assert not shared.record_outcome(FIVE_HUNDRED, 0.0, policy)
    assert shared.outlier.phase is Phase.CLOSED
    assert alone.record_outcome(FIVE_HUNDRED, 0.0, policy)  # "trio": 1 of 3, allowed
