"""One dispatched run as the edge holds it: events from the node, cancel, one release.

The node link delivers events; the HTTP layer iterates them. Whatever ends the
run (terminal event, cancel, node loss, the edge's own guards), the provider
slot is released exactly once.

The guards, on one timer per run, re-armed by itself (never per event):
- the acknowledgement: a node that registered ``acknowledges_runs`` must say it
  took the run within ``ack_timeout_s``, else the run fails
  ``provider_unavailable`` and ``unacknowledged`` tells the dispatcher the node
  itself is in doubt (frozen, cut off, its loop stuck);
- the first token: a streamed run with no delta ``first_token_timeout_s`` after it
  was sent fails ``provider_timeout``. Until its first delta a run waits in the
  node's queue, for a busy engine slot and for the prompt's prefill, which for a long
  prompt on a CPU takes minutes: the stall bound would cut it off;
- the stall: from its first delta on, a streamed run whose node sends nothing for
  ``stall_timeout_s`` fails ``provider_timeout`` (each event only notes the loop time);
- the deadline: the node enforces it, this catches a node that does not. It bounds
  the first token too (whichever passes first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from iop_edge.domain.events import (
    TERMINAL,
    Accepted,
    Completed,
    Delta,
    ErrorCode,
    Failed,
    RunEvent,
    RunOrder,
)
from iop_edge.ports import AttemptRecord


@dataclass(frozen=True, slots=True)
class RunGuards:
    """How long the edge waits for a node's acknowledgement and, in a stream, for the
    first delta and then between events, before it fails the run itself (0: not
    guarded; the settings' ``run_ack_timeout_s``, ``stall_timeout_s`` and
    ``first_token_timeout_s``)."""

    ack_timeout_s: float = 0.0
    stall_timeout_s: float = 0.0
    first_token_timeout_s: float = 0.0


UNGUARDED = RunGuards()
"""Only the deadline is guarded (the default of tests and tools that build runs)."""


class NodeLink(Protocol):
    """A registered node's connection, as dispatch uses it."""

    node_id: str
    acknowledges_runs: bool
    """The node sends ``Accepted`` for each run it takes (it said so when it registered)."""

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
        guards: RunGuards = UNGUARDED,
        loop: asyncio.AbstractEventLoop | None = None,  # the running one unless given
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
        # One timer per run (not a timeout per event: that cost showed in profiles), at
        # the earliest guard; when it fires it judges them all and re-arms itself.
        self._timed_out: Failed | None = None
        self.unacknowledged = False  # failed for want of the node's acknowledgement
        loop = self._loop = loop or asyncio.get_running_loop()
        now = loop.time()
        self._opened_at = now
        self._ended_at = 0.0
        self._expires_at = deadline + deadline_grace_s
        self._ack_timeout_s = guards.ack_timeout_s
        self._acked = guards.ack_timeout_s <= 0  # nothing to wait for
        self._ack_by = now + guards.ack_timeout_s
        self._stall_s = guards.stall_timeout_s if request.stream else 0.0
        self._last_event = now  # the stall clock: each event (judged from the first delta)
        self._first_token_s = guards.first_token_timeout_s if request.stream else 0.0
        self._awaiting_first = request.stream  # no delta yet: the first-token bound holds
        self._timer = loop.call_at(self._next_check(), self._check)

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

    def deliver(self, event: RunEvent | Accepted) -> None:
        """From the node link: queue the event; a terminal one releases the slot now.
        Any event is an acknowledgement; ``Accepted`` is nothing else (never queued)."""
        if self.finished:
            return
        self._acked = True
        if self._stall_s:
            self._last_event = self._loop.time()
        if isinstance(event, Accepted):
            return
        if self._awaiting_first and type(event) is Delta:
            self._awaiting_first = False
        self._push(event)
        if isinstance(event, TERMINAL):
            self._finish(event)

    def fail(self, code: ErrorCode, message: str) -> None:
        """End the run from the edge's side (node lost, edge stopping)."""
        if not self.finished:
            failure = Failed(code, message)
            self._push(failure)
            self._finish(failure)

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
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = events.popleft()
        if event is self._timed_out:
            await self._tell_node(event.message)
        if isinstance(event, TERMINAL):
            self._iterated = True  # the terminal event is the last one anyone sees
        return event

    def _next_check(self) -> float:
        """When the timer must next look: the earliest guard still open."""
        at = self._expires_at
        if not self._acked and self._ack_by < at:
            at = self._ack_by
        if self._awaiting_first:
            if self._first_token_s and self._opened_at + self._first_token_s < at:
                at = self._opened_at + self._first_token_s
        elif self._stall_s and self._last_event + self._stall_s < at:
            at = self._last_event + self._stall_s
        return at

    def _check(self) -> None:
        """The timer: fail the run for the first guard that passed, or re-arm."""
        if self.finished:
            return
        now = self._loop.time()
        if now >= self._expires_at:
            self._expire(Failed(ErrorCode.PROVIDER_TIMEOUT, "the provider did not answer in time"))
        elif not self._acked and now >= self._ack_by:
            self.unacknowledged = True
            self._expire(
                Failed(
                    ErrorCode.PROVIDER_UNAVAILABLE,
                    f"node {self.node_id} did not acknowledge the run within"
                    f" {self._ack_timeout_s:g} s",
                )
            )
        elif self._awaiting_first:
            if self._first_token_s and now - self._opened_at >= self._first_token_s:
                message = f"no first token within {self._first_token_s:g} s"
                self._expire(Failed(ErrorCode.PROVIDER_TIMEOUT, message))
            else:
                self._timer = self._loop.call_at(self._next_check(), self._check)
        elif self._stall_s and now - self._last_event >= self._stall_s:
            self._expire(Failed(ErrorCode.PROVIDER_TIMEOUT, f"no output for {self._stall_s:g} s"))
        else:
            self._timer = self._loop.call_at(self._next_check(), self._check)

    def _expire(self, failure: Failed) -> None:
        """The node did not do its part in time: end the run here so no client waits
        forever (whoever reads the events tells the node to drop it)."""
        self._timed_out = failure
        self._push(failure)
        self._finish(failure)

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
            self._ended_at = self._loop.time()
            self._timer.cancel()
            self._on_finish(self)

    def record(self) -> AttemptRecord:
        """This attempt for the run log."""
        outcome = self.outcome
        end = self._ended_at or self._loop.time()
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
