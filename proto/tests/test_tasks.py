"""cancel_and_wait: every task stopped, failures logged, the caller's own cancellation kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from loguru import logger

from iop_proto.tasks import cancel_and_wait


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lines.append, level="ERROR", format="{message}")
    yield lines
    logger.remove(handler)


async def test_every_task_is_cancelled_and_awaited() -> None:
    tasks = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]

    await cancel_and_wait(*tasks, None)

    assert all(task.cancelled() for task in tasks)


async def test_a_task_that_failed_is_logged_not_raised(log: list[str]) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(broken(), name="broken-task")
    await asyncio.wait([failed])
    sleeping = asyncio.create_task(asyncio.sleep(3600))

    await cancel_and_wait(failed, sleeping)

    assert sleeping.cancelled()
    assert any("task broken-task failed" in line and "boom" in line for line in log)


async def test_a_task_that_refuses_to_stop_at_once_is_waited_for() -> None:
    cleaned = asyncio.Event()

    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # cleanup that itself awaits
            cleaned.set()

    task = asyncio.create_task(slow_cleanup())
    await asyncio.sleep(0)

    await cancel_and_wait(task)

    assert cleaned.is_set()


async def test_the_caller_s_own_cancellation_is_not_swallowed() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():  # ignores cancellation until released
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    inner = asyncio.create_task(stubborn())
    outer = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.01)
    outer.cancel()

    with pytest.raises(asyncio.CancelledError):
        await outer
    assert outer.cancelled()
    release.set()
    await inner
