"""Runtime controls and their audit trail in the credential store, on each backend
(conftest's ``backend``: a SQLite file and a real PostgreSQL database)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from iop_control_plane.domain.controls import ControlChange, new_change_id
from iop_control_plane.ports import OpenedCredentialStore

Reopen = Callable[[], Awaitable[OpenedCredentialStore]]

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def change(
    target: str, before: str, after: str, at: datetime = NOW, kind: str = "state"
) -> ControlChange:
    return ControlChange(new_change_id(), at, "ops (key_1)", kind, target, before, after, "why")


async def test_a_change_is_in_force_and_in_the_audit_and_moves_the_marker(
    store: OpenedCredentialStore,
) -> None:
    marker = await store.change_marker()
    drain = change("node-a/p1", "", "draining")
    assert await store.record_control_change(drain)
    assert await store.change_marker() != marker
    [control] = await store.runtime_controls()
    assert (control.kind, control.target, control.value) == ("state", "node-a/p1", "draining")
    assert (control.change_id, control.changed_by, control.reason) == (
        drain.change_id,
        "ops (key_1)",
        "why",
    )
    assert control.changed_at == NOW
    assert await store.control_audit(10) == [drain]
    assert await store.control_audit(10, drain.change_id) == [drain]
    assert await store.control_audit(10, "chg_000000000000") == []


async def test_a_change_over_a_value_that_moved_is_refused_and_stores_nothing(
    store: OpenedCredentialStore,
) -> None:
    assert await store.record_control_change(change("node-a/p1", "", "disabled"))
    late = change("node-a/p1", "", "draining", NOW + timedelta(seconds=1))
    assert not await store.record_control_change(late)
    [control] = await store.runtime_controls()
    assert control.value == "disabled"
    assert [c.change_id for c in await store.control_audit(10)] != [late.change_id]
    assert len(await store.control_audit(10)) == 1


async def test_clearing_removes_the_control_and_the_audit_is_newest_first(
    store: OpenedCredentialStore,
) -> None:
    first = change("m", "", "a,b", kind="prefer")
    cleared = change("m", "a,b", "", NOW + timedelta(seconds=5), kind="prefer")
    assert await store.record_control_change(first)
    assert await store.record_control_change(cleared)
    assert await store.runtime_controls() == []
    assert [c.change_id for c in await store.control_audit(10)] == [
        cleared.change_id,
        first.change_id,
    ]
    assert [c.change_id for c in await store.control_audit(1)] == [cleared.change_id]


async def test_controls_survive_reopening(reopen: Reopen) -> None:
    store = await reopen()
    try:
        assert await store.record_control_change(change("node-b/p2", "", "5", kind="capacity"))
    finally:
        await store.aclose()
    store = await reopen()
    try:
        [control] = await store.runtime_controls()
        assert (control.kind, control.value) == ("capacity", "5")
        assert len(await store.control_audit(10)) == 1
    finally:
        await store.aclose()
