"""The per-model FIFO queue: requests wait here when no provider of the model has a slot.

Interactive requests always go before batch lines (worker issue): two FIFOs,
the batch one served only when no interactive request waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class ModelQueue(Generic[T]):
    """Waiters of one model; each waiter is a future that receives what it waited for."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._interactive: deque[asyncio.Future[T]] = deque()
        self._batch: deque[asyncio.Future[T]] = deque()

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    @property
    def interactive(self) -> int:
        return len(self._interactive)

    @property
    def batch(self) -> int:
        return len(self._batch)

    def push(self, waiter: asyncio.Future[T], *, batch: bool = False) -> None:
        (self._batch if batch else self._interactive).append(waiter)

    def remove(self, waiter: asyncio.Future[T]) -> None:
        for line in (self._interactive, self._batch):
            try:
                line.remove(waiter)
                return
            except ValueError:
                continue

    def pop_waiting(self) -> asyncio.Future[T] | None:
        """The oldest waiter still waiting, interactive first; ``None`` when empty."""
        for line in (self._interactive, self._batch):
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    return waiter
        return None

    def __iter__(self) -> Iterator[asyncio.Future[T]]:
        yield from self._interactive
        yield from self._batch
