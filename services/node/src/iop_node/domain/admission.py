"""The capacity gate and FIFO queue of one provider (the node's job, not an adapter's:
docs/ARCHITECTURE.md#node-execution).

A run starts only while ``in_flight < capacity``; otherwise it waits in a FIFO
of at most ``max_queue`` places. How long it may wait is its caller's one deadline
scope (``service.runs``: the queue timeout, bounded by the run's deadline), which
cancels the wait: a waiter that leaves, by a timeout or any cancellation, leaves the
queue, and a slot handed to it at that same moment is passed on, never lost. Every
slot taken is released exactly once, by the run that took it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from iop_node.errors import ProviderHeld, QueueFull


class AdmissionGate:
    """``in_flight`` and ``queued`` of one provider; the only place they change."""

    def __init__(self, provider_id: str, capacity: int, max_queue: int) -> None:
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.provider_id = provider_id
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_flight = 0
        self.held = ""  # an operator's "disabled" or "draining": no new run starts
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def take_free(self) -> bool:
        """Take a slot that is free now (none busy past capacity, nobody queued before):
        ``True``. ``False``: every slot is busy or others wait, and the run must queue
        (``acquire``). ``ProviderHeld`` while an operator holds the provider.

        The executor asks this first, so a run that never waits bounds itself by its
        deadline alone, with no queue timeout to set and then move."""
        if self.held:
            raise self._held_error()
        if self.in_flight < self.capacity and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self) -> float:
        """Take a slot, waiting in FIFO order; returns the seconds spent queued.

        ``QueueFull`` when every slot is busy and the queue too. The wait ends when a
        slot is handed over or the caller is cancelled (its deadline, its client gone):
        then it leaves the queue, passing on a slot handed to it in that same moment.
        """
        if self.take_free():
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
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # The slot was handed to us as we gave up: pass it on, never lose it.
                self.release()
            else:
                waiter.cancel()
                self._discard(waiter)
            raise
        return loop.time() - started

    def release(self) -> None:
        """Give a slot back: the head of the queue gets it, or it becomes free."""
        if self.in_flight <= 0:
            raise RuntimeError(f"provider {self.provider_id}: release without a held slot")
        self.in_flight -= 1
        if self._waiters:
            self._promote()

    def resize(self, capacity: int, max_queue: int) -> None:
        """Apply a new config; runs in flight keep their slots, waiters may start now."""
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.capacity = capacity
        self.max_queue = max_queue
        self._promote()

    def hold(self, state: str) -> None:
        """An operator's runtime control (docs/ARCHITECTURE.md#runtime-control): while
        ``state`` ("disabled", "draining"; "" lifts it), runs in flight go on, a new run is
        refused and every waiting one handed back now (``ProviderHeld``, retriable: the
        edge sends it elsewhere before its first byte)."""
        self.held = state
        if not state:
            self._promote()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self._held_error())

    def _held_error(self) -> ProviderHeld:
        return ProviderHeld(
            f"provider {self.provider_id} is {self.held} by an operator: run it elsewhere"
        )

    def _promote(self) -> None:
        while self._waiters and self.in_flight < self.capacity and not self.held:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
