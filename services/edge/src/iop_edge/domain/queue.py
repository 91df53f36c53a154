"""The per-model queue: requests wait here when no provider of the model has a slot.

Fair across keys, by class (docs/ARCHITECTURE.md#fair-queueing):

- **Classes**: every interactive request goes before every batch line (the batch
  class is the backfill, served last); among interactive requests a higher
  ``priority`` goes first. Within a class, keys take turns.
- **Turns**: start-time fair queueing (SFQ) with a unit cost per request. Each key's
  request gets a start tag ``max(V, the key's last finish)`` and its key's finish moves
  on by ``1 / weight``; the class serves the smallest start tag, ties by arrival, and
  ``V`` is the start tag last served. A key that arrives behind another's burst gets
  ``V``: it waits for at most one request of each key already waiting (``weight``
  requests of a heavier one), never for the burst. A key weighted 3 gets 3 turns for
  another's 1 while both wait. FIFO within a key (its tags only grow).

Why SFQ and not deficit round robin: the same bounds, but the order of every waiter
is a plain sort key (tag, arrival), so walking the queue in service order (a retry
that may not go back to some providers lets the next waiter take the slot) needs no
simulation of a ring. Unit cost, because what a request costs (its tokens) is known
only once it ran; a key's turns are requests, its share of slots.

A key with nobody waiting forgets its finish: it comes back at ``V`` like a new key
(an idle key earns no credit, so it cannot flood later with a saved-up share).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Share:
    """Who a waiter waits for: its key (an id; "" when the API is open), the key's
    ``weight`` (turns per round, at least 1) and ``priority`` (higher served first)."""

    key: str = ""
    weight: int = 1
    priority: int = 0


NO_SHARE = Share()

DEFAULT_MAX_SHARE = 1.0
"""The share of a model's slots batch lines may hold by default (edge setting
``batch.max_share``, ``service/backfill.py``): all of them. Preemption (on by default)
gives a batch line's slot to an interactive request within a cancel's round trip, so
slots kept idle for interactive work would only slow every batch on an idle pool, and
make lines past the share wait (and time out) in the queue. A share below 1 is for pools
where preemption is off, or where lines are long (a preempted line's work is lost):
then that part of the pool never holds a batch line at all."""


@dataclass(slots=True)
class _KeyLine(Generic[T]):
    """One key's waiters in a class, oldest first, and where its next start tag begins."""

    finish: float
    entries: deque[tuple[float, int, asyncio.Future[T]]] = field(default_factory=deque)


@dataclass(slots=True)
class _Class(Generic[T]):
    """The waiters of one class, by key, and its virtual time ``vtime``."""

    vtime: float = 0.0
    lines: dict[str, _KeyLine[T]] = field(default_factory=dict)


Rank = tuple[bool, int]  # (batch, -priority): the smallest rank is served first


class ModelQueue(Generic[T]):
    """Waiters of one model; each waiter is a future that receives what it waited for."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._classes: dict[Rank, _Class[T]] = {}
        self._where: dict[asyncio.Future[T], tuple[Rank, str]] = {}
        self._arrivals = itertools.count()
        self._batch = 0

    def __len__(self) -> int:
        return len(self._where)

    @property
    def interactive(self) -> int:
        return len(self._where) - self._batch

    @property
    def batch(self) -> int:
        return self._batch

    def push(
        self, waiter: asyncio.Future[T], *, batch: bool = False, share: Share = NO_SHARE
    ) -> None:
        rank = (batch, -share.priority)
        cls = self._classes.get(rank)
        if cls is None:
            cls = self._classes[rank] = _Class()
        line = cls.lines.get(share.key)
        if line is None:
            line = cls.lines[share.key] = _KeyLine(cls.vtime)
        start = max(cls.vtime, line.finish)
        line.finish = start + 1 / max(1, share.weight)
        line.entries.append((start, next(self._arrivals), waiter))
        self._where[waiter] = (rank, share.key)
        if batch:
            self._batch += 1

    def remove(self, waiter: asyncio.Future[T]) -> None:
        where = self._where.get(waiter)
        if where is None:
            return
        rank, key = where
        line = self._classes[rank].lines[key]
        for entry in line.entries:
            if entry[2] is waiter:
                line.entries.remove(entry)
                break
        self._forget(waiter, rank, key)

    def pop_waiting(self, *, batch: bool = True) -> asyncio.Future[T] | None:
        """The next waiter still waiting, in service order; ``None`` when empty.
        ``batch=False``: interactive waiters only (batch may take no more slots)."""
        for rank in sorted(self._classes):
            if rank[0] and not batch:
                return None
            cls = self._classes.get(rank)
            while cls is not None and cls.lines:
                key, line = min(cls.lines.items(), key=lambda item: item[1].entries[0][:2])
                start, _, waiter = line.entries.popleft()
                cls.vtime = start
                self._forget(waiter, rank, key)
                if not waiter.done():
                    return waiter
                cls = self._classes.get(rank)
        return None

    def __iter__(self) -> Iterator[asyncio.Future[T]]:
        """Every waiter in service order (as ``pop_waiting`` would hand them out)."""
        for rank in sorted(self._classes):
            lines = [line.entries for line in self._classes[rank].lines.values()]
            for _, _, waiter in heapq.merge(*lines, key=lambda entry: entry[:2]):
                yield waiter

    def _forget(self, waiter: asyncio.Future[T], rank: Rank, key: str) -> None:
        """``waiter`` left its line: an emptied line and class go (a key with nobody
        waiting earns no credit: it comes back at the class's virtual time)."""
        del self._where[waiter]
        if rank[0]:
            self._batch -= 1
        cls = self._classes[rank]
        if not cls.lines[key].entries:
            del cls.lines[key]
        if not cls.lines:
            del self._classes[rank]
