"""One dispatched run as the edge holds it: events from the node, cancel, one release.

The node link delivers events; the HTTP layer iterates them. Whatever ends the
run (terminal event, cancel, node loss, the edge's own deadline guard), the
provider slot is released exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Protocol

from iop_edge.domain.events import TERMINAL, Completed, ErrorCode, Failed, RunEvent, RunOrder
from iop_edge.ports import AttemptRecord


class NodeLink(Protocol):
    """A registered node's connection, as dispatch uses it."""

    node_id: str

    async def send_run(self, order: RunOrder) -> None: ...

    async def send_cancel(self, run_id: str, reason: str) -> None: ...


class EdgeRun:
    """One run on one provider: one attempt of a request (``FailoverRun`` holds them all),
    iterated like ``RunEvents``."""

    def __init__(
        self,
        run_id: str,
        request: RunOrder,
        provider_id: str,
        node: NodeLink,
        target: str,
        deadline: float,
        on_finish: Callable[[EdgeRun], None],
        deadline_grace_s: float,
        started_ms: int = 0,
    ) -> None:
        self.run_id = run_id
        self.request = request
        self.provider_id = provider_id
        self.node_id = node.node_id
        self.target = target
        self._node = node
        self._deadline = deadline
        self._on_finish = on_finish
        # A deque and one waiter, not an asyncio.Queue: one reader, no bound, and a
        # queue's bookkeeping showed in the profiles of every run.
        self._events: deque[RunEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._iterated = False
        self.finished = False
        self.outcome: Completed | Failed | None = None  # the terminal event, once finished
        self.edge_queue_wait_s = 0.0
        self.started_ms = started_ms  # Unix ms, for the run log
        loop = asyncio.get_running_loop()
        self._opened_at = loop.time()
        self._ended_at = 0.0
        # One timer per run (not a timeout per event: that cost showed in profiles).
        self._timed_out: Failed | None = None
        self._timer = loop.call_at(deadline + deadline_grace_s, self._expire)

    @property
    def deadline(self) -> float:
        """When the provider's answer is due (the loop's clock)."""
        return self._deadline

    async def send(self) -> None:
        """Send the run request to its node (``Dispatcher.open_run`` undoes a failure)."""
        await self._node.send_run(self.request)

    async def abandon(self, reason: str, *, sent: bool, failure: Failed | None = None) -> None:
        """The run did not reach its node for sure: end it now (the slot goes back at
        once, whatever follows) and, when its frame may have left (``sent``), ask the node
        to drop it; shielded, so a second cancellation cannot keep the node running it.
        With ``failure``, that is the run's last event (the reader fails over from it)."""
        if failure is not None and not self.finished:
            self._push(failure)
        self._finish(failure)
        if sent:
            await asyncio.shield(self._tell_node(reason))

    def deliver(self, event: RunEvent) -> None:
        """From the node link: queue the event; a terminal one releases the slot now."""
        if self.finished:
            return
        self._push(event)
        if isinstance(event, TERMINAL):
            self._finish(event)

    def fail(self, code: ErrorCode, message: str) -> None:
        """End the run from the edge's side (node lost, edge stopping)."""
        self.deliver(Failed(code, message))

    @property
    def link(self) -> NodeLink:
        """The connection the run was dispatched on: the only one its events may come from."""
        return self._node

    @property
    def more_ready(self) -> bool:
        """Events wait already: a relay can write them out together with this one."""
        return bool(self._events)

    def _push(self, event: RunEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> EdgeRun:
        # The run is its own iterator (one reader): an async generator would cost a
        # registration with the loop's generator hooks per run.
        return self

    async def __anext__(self) -> RunEvent:
        if self._iterated:
            raise StopAsyncIteration
        events = self._events
        if not events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = events.popleft()
        if event is self._timed_out:
            await self._tell_node("deadline passed without an answer from the node")
        if isinstance(event, TERMINAL):
            self._iterated = True  # the terminal event is the last one anyone sees
        return event

    def _expire(self) -> None:
        """The node never ended the run: end it here so no client waits forever."""
        if self.finished:
            return
        self._timed_out = Failed(ErrorCode.PROVIDER_TIMEOUT, "the provider did not answer in time")
        self._push(self._timed_out)
        self._finish(self._timed_out)

    async def cancel(self, reason: str) -> None:
        """Client gone: tell the node to abort the provider call, and free the slot."""
        if self.finished:
            return
        # Whoever iterates the events (if anyone) ends with this run's terminal event.
        cancelled = Failed(ErrorCode.CANCELLED, reason)
        self._push(cancelled)
        self._finish(cancelled)
        await self._tell_node(reason)

    async def _tell_node(self, reason: str) -> None:
        # A node that is gone cancelled its runs with its connection already.
        with contextlib.suppress(ConnectionError):
            await self._node.send_cancel(self.run_id, reason)

    def _finish(self, outcome: Completed | Failed | None = None) -> None:
        if not self.finished:
            self.finished = True
            self.outcome = outcome
            self._ended_at = asyncio.get_running_loop().time()
            self._timer.cancel()
            self._on_finish(self)

    def record(self) -> AttemptRecord:
        """This attempt for the run log."""
        outcome = self.outcome
        end = self._ended_at or asyncio.get_running_loop().time()
        if outcome is None:
            state, code = ("failed" if self.finished else "running"), ""
        elif isinstance(outcome, Completed):
            state, code = "completed", ""
        else:
            cancelled = outcome.code is ErrorCode.CANCELLED
            state, code = ("cancelled" if cancelled else "failed"), outcome.code.value
        return AttemptRecord(
            run_id=self.run_id,
            provider_id=self.provider_id,
            node_id=self.node_id,
            outcome=state,
            error_code=code,
            started_ms=self.started_ms,
            duration_ms=max(1, round((end - self._opened_at) * 1000)),
        )
