"""An operator's hold on a provider's gate (runtime control: disabled, draining): runs
under way keep their slots, waiting ones are handed back retriable, new ones refused."""

from __future__ import annotations

import asyncio

import pytest

from iop_node.domain.admission import AdmissionGate
from iop_node.errors import ErrorCode, ProviderHeld


async def test_a_hold_hands_back_the_waiters_and_refuses_new_runs() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    await gate.acquire()  # a run under way
    waiting = [asyncio.create_task(gate.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    assert gate.queued == 3
    gate.hold("draining")
    for task in waiting:
        with pytest.raises(ProviderHeld, match="draining by an operator") as caught:
            await task
        assert caught.value.code is ErrorCode.PROVIDER_UNAVAILABLE  # the edge fails over
    assert (gate.in_flight, gate.queued) == (1, 0)  # the run under way kept its slot
    with pytest.raises(ProviderHeld):
        await gate.acquire()
    gate.release()  # it finishes: nothing is started in its place
    assert gate.in_flight == 0


async def test_lifting_the_hold_serves_again() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    gate.hold("disabled")
    with pytest.raises(ProviderHeld):
        await gate.acquire()
    gate.hold("")
    assert await gate.acquire() == 0.0
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()
    await waiter
    assert gate.in_flight == 1
