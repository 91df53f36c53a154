"""Reading a run's events: the one ``match`` over ``Delta | Completed | Failed | Retrying``.

The streaming relay, the non-streaming answer and batch lines all read a run
the same way: deltas go to a ``RunSink`` as they come, the run's end is returned
(its start is the run's own fact: ``RunEvents.node_wait_ms``). What each does with
a delta (write a chunk, keep it) is its own. A ``Retrying`` between two attempts
(docs/ARCHITECTURE.md#failover) tells the sink to drop what it kept: the next
attempt starts clean.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from iop_edge.domain.events import Completed, Delta, Failed, Retrying
from iop_edge.ports import RunEvents


class RunSink(Protocol):
    """What a reader does with the events before the end."""

    def delta(self, event: Delta, more: bool) -> Awaitable[None] | None:
        """Take one delta; what it returns (a write, say) is awaited before the next.
        ``more``: other events arrived with it and follow at once (a relay may hold it
        back to write them together). Not a coroutine itself: a sink that only keeps the
        delta, or batches it with the next ones, has nothing to wait for; the reader
        awaits what it returns."""
        ...

    def restart(self) -> None:
        """The run failed before its first byte and starts again elsewhere: what was
        kept of it is void."""
        ...


async def follow(events: RunEvents, sink: RunSink) -> Completed | Failed | None:
    """Feed ``sink`` until the run ends; its terminal event (``None``: the events
    stopped without one, which only a broken run does)."""
    while batch := await events.next_events():
        last = batch[-1]
        for event in batch:
            match event:
                case Delta():  # first: nearly every event is one
                    wait = sink.delta(event, event is not last)
                    if wait is not None:
                        await wait
                case Completed() | Failed():
                    return event
                case Retrying():
                    sink.restart()
    return None


class RunWatcher(Protocol):
    """Who times the run (the HTTP layer's trace): its first delta."""

    def first_delta(self) -> None: ...

    def restarted(self) -> None:
        """The run starts again elsewhere: its first delta is yet to come."""
        ...


class Collector:
    """A ``RunSink`` that keeps the deltas for one answer at the end; ``watcher`` is told
    of each delta as it comes."""

    __slots__ = ("_watcher", "deltas")

    def __init__(self, watcher: RunWatcher | None = None) -> None:
        self.deltas: list[Delta] = []
        self._watcher = watcher

    def delta(self, event: Delta, more: bool) -> None:
        if self._watcher is not None:
            self._watcher.first_delta()
        self.deltas.append(event)

    def restart(self) -> None:
        self.deltas.clear()  # the failed attempt's: the answer is the next attempt's alone
        if self._watcher is not None:
            self._watcher.restarted()
