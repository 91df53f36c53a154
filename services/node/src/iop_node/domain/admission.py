"""The capacity gate and FIFO queue of one provider (the node's job, not an adapter's:
docs/ARCHITECTURE.md#node-execution).

A run starts only while ``in_flight < capacity``; otherwise it waits in a FIFO
of at most ``max_queue`` places for at most its queue timeout. Every slot is
released exactly once, whatever ends the run: ``Admission`` is a context
manager, and a slot handed to a waiter that was cancelled at the same moment is
passed on, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType

from iop_node.errors import QueueFull, QueueTimeout


class AdmissionGate:
    """``in_flight`` and ``queued`` of one provider; the only place they change."""

    def __init__(self, provider_id: str, capacity: int, max_queue: int) -> None:
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.provider_id = provider_id
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def admit(self, queue_timeout_s: float) -> Admission:
        """``async with gate.admit(t):`` holds one slot for the body of the block."""
        return Admission(self, queue_timeout_s)

    async def acquire(self, queue_timeout_s: float) -> float:
        """Take a slot, waiting in FIFO order; returns the seconds spent queued."""
        if self.in_flight < self.capacity and not self._waiters:
            self.in_flight += 1
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(
                f"provider {self.provider_id}: {self.in_flight} of {self.capacity} slots busy "
                f"and the queue is full ({self.max_queue} waiting)"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(queue_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed to us as we gave up: pass it on, never lose it.
                self.release()
            else:
                waiter.cancel()
                self._discard(waiter)
            if isinstance(exc, TimeoutError):
                waited_ms = queue_timeout_s * 1000
                raise QueueTimeout(
                    f"provider {self.provider_id}: no slot free within {waited_ms:.0f} ms"
                ) from None
            raise
        return loop.time() - started

    def release(self) -> None:
        """Give a slot back: the head of the queue gets it, or it becomes free."""
        if self.in_flight <= 0:
            raise RuntimeError(f"provider {self.provider_id}: release without a held slot")
        self.in_flight -= 1
        self._promote()

    def resize(self, capacity: int, max_queue: int) -> None:
        """Apply a new config; runs in flight keep their slots, waiters may start now."""
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.capacity = capacity
        self.max_queue = max_queue
        self._promote()

    def _promote(self) -> None:
        while self._waiters and self.in_flight < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


class Admission:
    """One slot held for the duration of an ``async with`` block."""

    def __init__(self, gate: AdmissionGate, queue_timeout_s: float) -> None:
        self._gate = gate
        self._queue_timeout_s = queue_timeout_s
        self.queue_wait_s = 0.0

    async def __aenter__(self) -> Admission:
        self.queue_wait_s = await self._gate.acquire(self._queue_timeout_s)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._gate.release()


class Ungated:
    """No slot: what a run the gate does not count holds (``count_tokens``, which the
    engine answers from its tokenizer beside the generations, without one of their slots)."""

    queue_wait_s = 0.0

    async def __aenter__(self) -> Ungated:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None
