"""The capacity gate and FIFO queue: order, limits, and release on every exit path (the
wait itself is bounded by its caller's deadline scope: ``service.runs``)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_node.domain.admission import AdmissionGate
from iop_node.errors import QueueFull


async def test_runs_start_while_slots_are_free() -> None:
    gate = AdmissionGate("p", capacity=2, max_queue=0)
    assert await gate.acquire() == 0.0
    assert await gate.acquire() == 0.0
    assert gate.in_flight == 2
    with pytest.raises(QueueFull, match=r"2 of 2 slots busy and the queue is full \(0 waiting\)"):
        await gate.acquire()


async def test_a_free_slot_is_taken_at_once_and_never_past_a_waiter() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=1)
    assert gate.take_free()
    assert gate.in_flight == 1
    assert not gate.take_free()  # busy: the run must queue (acquire)
    waiting = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # handed to the waiter, not left free
    assert not gate.take_free()
    await waiting
    assert (gate.in_flight, gate.queued) == (1, 0)
    gate.release()
    gate.hold("draining")
    with pytest.raises(QueueFull, match="draining"):
        gate.take_free()
    assert gate.in_flight == 0


async def test_waiters_are_served_in_fifo_order() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=10)
    await gate.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await gate.acquire()
        try:
            order.append(i)
        finally:
            gate.release()

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(waiter(i)))
        await asyncio.sleep(0)  # let each one queue before the next
    assert gate.queued == 5
    gate.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_queue_overflow_is_refused_with_a_clear_reason() -> None:
    gate = AdmissionGate("gpu-a", capacity=1, max_queue=1)
    await gate.acquire()
    queued = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="gpu-a"):
        await gate.acquire()
    gate.release()
    await queued
    gate.release()
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_queue_timeout_leaves_the_queue() -> None:
    """The caller's scope ends the wait (its message: test_executor's queue timeout)."""
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    await gate.acquire()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await gate.acquire()
    assert gate.queued == 0
    gate.release()
    assert gate.in_flight == 0


async def test_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_slot() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    second = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert gate.queued == 1
    gate.release()
    await second
    assert gate.in_flight == 1


async def test_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    second = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # hands the slot to `first` ...
    first.cancel()  # ... which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await second  # the slot went on to `second`
    assert first.cancelled()
    assert gate.in_flight == 1
    gate.release()
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_resize_lets_waiters_start() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=4)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.resize(capacity=2, max_queue=4)
    await waiter
    assert gate.in_flight == 2


async def test_release_without_a_slot_is_a_bug() -> None:
    gate = AdmissionGate("p", capacity=1, max_queue=0)
    with pytest.raises(RuntimeError):
        gate.release()


ENDINGS = st.sampled_from(["complete", "error", "cancel", "timeout"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 4),
    max_queue=st.integers(0, 6),
    runs=st.lists(st.tuples(ENDINGS, st.integers(0, 3)), min_size=1, max_size=20),
)
async def test_counts_return_to_zero_whatever_ends_the_runs(
    capacity: int, max_queue: int, runs: list[tuple[str, int]]
) -> None:
    """Random interleavings of complete/error/cancel/timeout never leak a slot or a place."""
    gate = AdmissionGate("p", capacity, max_queue)
    release = asyncio.Event()
    peak = 0

    async def run(ending: str, yields: int) -> None:
        nonlocal peak
        timeout = 0.001 if ending == "timeout" else 10
        async with asyncio.timeout(timeout):  # the queue wait's bound, as the executor's
            await gate.acquire()
        try:
            peak = max(peak, gate.in_flight)
            assert gate.in_flight <= capacity
            for _ in range(yields):
                await asyncio.sleep(0)
            if ending == "error":
                raise ValueError("provider failed")
            if ending == "timeout":
                await release.wait()
        finally:
            gate.release()

    tasks = [asyncio.create_task(run(ending, yields)) for ending, yields in runs]
    for (ending, yields), task in zip(runs, tasks, strict=True):
        for _ in range(yields):
            await asyncio.sleep(0)
        if ending == "cancel":
            task.cancel()
    await asyncio.sleep(0.005)
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(
        r is None or isinstance(r, ValueError | QueueFull | TimeoutError | asyncio.CancelledError)
        for r in results
    )
    assert (gate.in_flight, gate.queued) == (0, 0)
    assert peak <= capacity
