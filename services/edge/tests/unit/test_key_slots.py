"""``KeySlots`` with a shared ``KeyConcurrency`` store: a slot is given back exactly once
per slot taken, on every way a request ends; only keys with a limit ask the store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_auth import KeySlots
from iop_edge.errors import KeyRevoked, TooManyConcurrent
from iop_edge.ports import KeySlot


class Recording:
    """A ``KeyConcurrency`` that counts like the store would and records every call;
    ``gate``: acquires wait for it (a slow store)."""

    def __init__(self) -> None:
        self.given: list[KeySlot] = []
        self.released: list[KeySlot] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.asking = asyncio.Event()

    async def acquire(self, key_id: str, limit: int) -> KeySlot | None:
        self.asking.set()
        await self.gate.wait()
        held = len(self.given) - len(self.released)
        if held >= limit:
            return None
        slot = KeySlot(key_id, f"s{len(self.given)}")
        self.given.append(slot)
        return slot

    async def release(self, slot: KeySlot) -> None:
        assert slot in self.given
        self.released.append(slot)


class Run:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, reason: str, error: Any = None) -> None:
        self.cancelled.append(reason)


LIMITED = ApiKeyEntry("k", "k", "hash", frozenset(), 2)
UNLIMITED = ApiKeyEntry("u", "u", "hash", frozenset(), 0)


async def test_each_slot_is_given_back_once_on_every_way_out() -> None:
    port = Recording()
    slots = KeySlots(port)
    async with slots.hold(LIMITED, Run()):
        assert slots.held("k") == 1
    with pytest.raises(ValueError, match="boom"):
        async with slots.hold(LIMITED, Run()):
            raise ValueError("boom")

    inside = asyncio.Event()

    async def cancelled() -> None:
        async with slots.hold(LIMITED, Run()):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(cancelled())
    await inside.wait()
    assert slots.held("k") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert port.released == port.given
    assert len(port.given) == 3
    assert slots.held("k") == 0


async def test_a_key_at_its_limit_is_refused_and_takes_nothing() -> None:
    port = Recording()
    slots = KeySlots(port)
    async with slots.hold(LIMITED, Run()), slots.hold(LIMITED, Run()):
        with pytest.raises(TooManyConcurrent):
            slots.check_room(LIMITED)  # this edge alone is at the limit: before the body
        with pytest.raises(TooManyConcurrent):
            async with slots.hold(LIMITED, Run()):
                pytest.fail("not reached")
    assert len(port.given) == 2
    assert sorted(port.released, key=str) == port.given  # the inner block's first


async def test_the_store_refusing_a_slot_another_edge_holds_is_a_429() -> None:
    port = Recording()
    port.given.extend([KeySlot("k", "elsewhere-1"), KeySlot("k", "elsewhere-2")])
    slots = KeySlots(port)
    slots.check_room(LIMITED)  # nothing held here
    with pytest.raises(TooManyConcurrent):
        async with slots.hold(LIMITED, Run()):
            pytest.fail("not reached")
    assert port.released == []


async def test_a_key_without_a_limit_never_asks_the_port() -> None:
    port = Recording()
    slots = KeySlots(port)
    async with slots.hold(UNLIMITED, Run()), slots.hold(None, Run()):
        assert slots.held("u") == 1
    assert port.given == []
    assert slots.held("u") == 0


async def test_a_revocation_while_the_slot_is_taken_gives_it_back_and_refuses() -> None:
    port = Recording()
    port.gate.clear()
    slots = KeySlots(port)
    await slots.apply_keys(frozenset({"k"}))
    entering = asyncio.create_task(slots.hold(LIMITED, Run()).__aenter__())
    await port.asking.wait()
    assert await slots.apply_keys(frozenset()) == 0  # nothing held yet to end
    port.gate.set()
    with pytest.raises(KeyRevoked):
        await entering
    assert port.released == port.given
    assert len(port.given) == 1
    assert slots.held("k") == 0


async def test_without_a_shared_store_this_edge_counts_alone() -> None:
    slots = KeySlots()
    async with slots.hold(LIMITED, Run()), slots.hold(LIMITED, Run()):
        assert slots.held("k") == 2
        with pytest.raises(TooManyConcurrent):
            async with slots.hold(LIMITED, Run()):
                pytest.fail("not reached")
    assert slots.held("k") == 0
