"""The request's run: one owner from admission to one outcome (docs/ARCHITECTURE.md#the-run).

A ``RequestRun`` is made when the dispatcher admits a request, before any wait, and
lives until its one ``end``: waiting for a slot (in its model's queue, or aside for its
cache's provider), dispatched to a node, failing over before its first byte
(docs/ARCHITECTURE.md#failover), ended. Every way a request can end goes through
``end`` (first caller wins): the node's terminal event, the client gone, its key
revoked, a guard or the queue timeout, the drain, a failure of the edge or of the node
link. Whatever its state then, ``end`` gives back what the run holds: its place in a
queue (the waiter is a future the run owns: ending the run resolves it, so no task is
cancelled to get a request out of a queue), a slot handed to it, its attempt's slot.

Each attempt has a run id of its own (a node that failed a run is never asked to run
that id again); the first one's is the client's. A retryable failure before the first
byte leaves the run waiting for its reader, which opens the next attempt in its own
task (``Retrying`` tells it to drop what it kept). A node holding an attempt the edge
cut short (a guard, the client, the key) is told to drop it, exactly once, by whoever
comes first: the one ending it (``cancel``) or the reader.

The guards, on one timer per run (re-armed by itself, never per event):
- the queue timeout, while the run waits for a slot;
- the acknowledgement: a node that registered ``acknowledges_runs`` must say it took
  the attempt within ``ack_timeout_s``, else it fails ``provider_unavailable`` and
  ``unacknowledged`` tells the dispatcher the node itself is in doubt;
- the first token: a streamed attempt with no delta ``first_token_timeout_s`` after it
  was sent fails ``provider_timeout`` (a long prompt's prefill may take minutes: the
  stall bound would cut it off);
- the stall: from its first delta on, a streamed attempt whose node sends nothing for
  ``stall_timeout_s`` fails ``provider_timeout`` (each event only notes the loop time);
- the deadline: the node enforces it, this catches a node that does not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from iop_edge.domain.events import (
    Accepted,
    Completed,
    Delta,
    ErrorCode,
    Failed,
    Retrying,
    RunEvent,
    RunOrder,
    Started,
)
from iop_edge.domain.faults import retryable
from iop_edge.domain.fleet import ModelEntry
from iop_edge.domain.pool import ProviderSlot
from iop_edge.errors import EdgeError, QueueTimeout, from_failure
from iop_edge.ports import AttemptRecord, RunSpec
from iop_edge.service.limits import RunBody
from iop_edge.service.runs import NodeLink, RunGuards

CLIENT_GONE = "client disconnected"
ACK_SECONDS_PER_MIB = 1.0
"""What a node is given beyond ``run_ack_timeout_s`` to acknowledge, per MiB of the order's
body: it reads, decrypts and decodes the whole order before it can, and on a busy host a
14 MiB one has taken it over 2 s. A few-KiB order gains milliseconds."""


class RunOwner(Protocol):
    """What a run asks of the dispatcher that admitted it."""

    async def attempt(
        self,
        run: RequestRun,
        model: ModelEntry,
        exclude: frozenset[str],
        deadline: float | None,
    ) -> None:
        """Take a slot for the run's first attempt (maybe after a wait) and send it:
        on a provider of ``model`` outside ``exclude``, by ``deadline`` if one is given."""
        ...

    async def reopen(self, run: RequestRun, failed: Failed) -> None:
        """The run's next attempt, on a provider outside ``run.exclude``; raises an
        ``EdgeError`` when none can take it in time."""
        ...

    def attempt_over(self, run: RequestRun, outcome: Completed | Failed) -> None:
        """The run's attempt ended: its slot goes back, its outcome is booked."""
        ...

    def provider_failed(self, run: RequestRun, failed: Failed) -> None:
        """The node reported the attempt's failure (before the attempt is over)."""
        ...

    def first_delta(self, run: RequestRun) -> None:
        """The attempt's first delta arrived: its provider answers, so it holds the model."""
        ...

    def release(self, slot: ProviderSlot, run: RequestRun) -> None:
        """A slot ``run`` held without an attempt on it goes back."""
        ...


class RequestRun:
    """Implements ``RunEvents``: one request's run (see the module's docstring)."""

    __slots__ = (
        "_ack_by",
        "_ack_timeout_s",
        "_acked",
        "_awaiting_first",
        "_events",
        "_expires_at",
        "_failed",
        "_first_token_s",
        "_iterated",
        "_last_event",
        "_last_failure",
        "_leave_place",
        "_loop",
        "_opened_at",
        "_order_left",
        "_owner",
        "_reader",
        "_records",
        "_refusal",
        "_retries",
        "_stall_s",
        "_started_ms",
        "_timer",
        "_untold",
        "_waiter",
        "answered",
        "attempt_id",
        "body",
        "deadline",
        "edge_queue_wait_s",
        "exclude",
        "lacking",
        "link",
        "model",
        "node_id",
        "node_wait_ms",
        "outcome",
        "provider_id",
        "run_id",
        "slot",
        "spec",
        "target",
        "unacknowledged",
    )

    def __init__(
        self,
        owner: RunOwner,
        spec: RunSpec,
        body: RunBody,
        model: ModelEntry,
        lacking: frozenset[str],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.spec = spec
        self.body = body  # encoded once, for every attempt
        self.model = model
        self.lacking = lacking  # providers of the model without the request's operation
        self.run_id = ""  # the client's: its first attempt's, once dispatched
        self.outcome: Completed | Failed | None = None  # set once, by ``end``
        self._owner = owner
        self._loop = loop
        self._refusal: EdgeError | None = None  # the edge's own reason, when it has one
        # A deque and one waiter, not an asyncio.Queue: one reader, no bound.
        self._events: deque[RunEvent] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._iterated = False
        # While it waits for a slot: the future a slot is handed through, and how its
        # place (in a queue, or aside) is given back.
        self._waiter: asyncio.Future[ProviderSlot | None] | None = None
        self._leave_place: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Failover.
        self._retries = model.retries
        self.exclude: frozenset[str] = frozenset()  # providers that failed it
        self.deadline = 0.0  # the request's (its first attempt's): no attempt runs past it
        self._failed: Failed | None = None  # the attempt failed; the reader fails over
        self._last_failure: Failed | None = None  # while it fails over
        # Each attempt over: (its id, provider, node, outcome, start in Unix ms, seconds).
        self._records: list[tuple[str, str, str, Completed | Failed | None, int, float]] = []
        # The attempt in progress (or the last one).
        self.attempt_id = ""
        self.provider_id = ""
        self.node_id = ""
        self.target = ""
        self.node_wait_ms = 0  # the node's queue, as the attempt's start said
        self.link: NodeLink | None = None  # while an attempt is on its node
        self.slot: ProviderSlot | None = None  # the slot it holds (none for count_tokens)
        self.edge_queue_wait_s = 0.0
        self.unacknowledged = False  # failed for want of the node's acknowledgement
        self.answered = False  # the attempt's first delta arrived
        self._untold: tuple[NodeLink, str, str] | None = None  # a node to tell to drop it
        self._started_ms = 0
        self._opened_at = 0.0
        self._expires_at = 0.0
        self._acked = True
        self._order_left = True
        self._ack_by = 0.0
        self._ack_timeout_s = 0.0
        self._stall_s = 0.0
        self._last_event = 0.0
        self._first_token_s = 0.0
        self._awaiting_first = False

    # ------------------------------------------------------------ the one end

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    @property
    def attempt_finished(self) -> bool:
        """No attempt of the run is on a node now (the last one is over)."""
        return self.link is None

    def end(self, outcome: Completed | Failed, refusal: EdgeError | None = None) -> None:
        """End the run with ``outcome`` (the reader's last event); ``refusal``: what the
        client sees instead of the failure's own error (a revoked key, a drained queue).
        The first call wins; whatever the run held goes back now."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._refusal = refusal
        self._failed = None
        if self.link is not None:
            self._attempt_over(outcome, told=False)
        elif self._waiter is not None:
            self._leave(self.error(outcome) if isinstance(outcome, Failed) else None)
        elif self.slot is not None:  # handed a slot, no attempt on it yet
            slot, self.slot = self.slot, None
            self._owner.release(slot, self)
        if self._timer is not None:
            self._timer.cancel()
        self._wake()

    def refuse(self, error: EdgeError) -> None:
        """The edge turns the run away before an attempt: a request not yet dispatched
        ends with ``error``; one failing over with the failure it had (the client gets
        what it got)."""
        if self._last_failure is not None:
            self.end(self._last_failure)
        else:
            self.end(Failed(ErrorCode.CANCELLED, str(error)), error)

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        """End the run from outside (client gone, key revoked, edge stopping), and tell
        a node that has it to drop it."""
        self.end(Failed(ErrorCode.CANCELLED, reason), error)
        if self._untold is not None:
            await self._tell_node()

    def error(self, failed: Failed) -> EdgeError:
        """What the client sees for the run's failure: the edge's own reason when it
        ended the run for one, else the failure's."""
        return self._refusal if self._refusal is not None else from_failure(failed)

    # ------------------------------------------------------------ admission to dispatch

    async def open(self) -> None:
        """Take a slot (maybe after a wait) and send the first attempt. Raises what
        turned the request away; on any failure at all (a cancellation too) the run has
        ended, what it held is back, and a node that may have it is told."""
        try:
            await self._owner.attempt(self, self.model, self.lacking, None)
        except BaseException as exc:
            if isinstance(exc, EdgeError):
                self.refuse(exc)
            elif isinstance(exc, asyncio.CancelledError):
                self.end(Failed(ErrorCode.CANCELLED, CLIENT_GONE))
            else:
                self.end(Failed(ErrorCode.INTERNAL, f"not dispatched: {type(exc).__name__}"))
            if self._untold is not None:  # shielded: a second cancellation cannot skip it
                await asyncio.shield(self._tell_node())
            raise

    def wait(
        self,
        waiter: asyncio.Future[ProviderSlot | None],
        leave: Callable[[], None],
        timeout: tuple[float, str] | None = None,
    ) -> None:
        """The run waits for ``waiter``; ``leave`` gives its place back. ``timeout``:
        (seconds, message) after which the run ends with ``QueueTimeout``."""
        self._waiter = waiter
        self._leave_place = leave
        if timeout is not None:
            seconds, message = timeout
            self._timer = self._loop.call_later(seconds, self.refuse, QueueTimeout(message))

    def placed(self) -> None:
        """The wait is over (a slot came, or the run goes on to wait elsewhere). Raises
        what ended the run if it ended meanwhile: a slot handed to it went back then."""
        if isinstance(self.outcome, Failed):
            raise self.error(self.outcome)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()  # nobody may hand it a slot any more
        self._leave(None)

    def _leave(self, error: EdgeError | None) -> None:
        waiter, leave = self._waiter, self._leave_place
        self._waiter = self._leave_place = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if waiter is not None and error is not None:
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # its reader may have left already: nothing to log
            elif not waiter.cancelled() and (slot := waiter.result()) is not None:
                self._owner.release(slot, self)  # handed a slot as it ended: passed on
        if leave is not None:
            leave()

    # ------------------------------------------------------------ an attempt

    def attempt(
        self,
        order: RunOrder,
        link: NodeLink,
        guards: RunGuards,
        timeout_s: float,
        grace_s: float,
        started_ms: int,
    ) -> None:
        """``order`` is on its way to ``link``'s node: the attempt's guards start."""
        now = self._loop.time()
        if not self.run_id:
            self.run_id = order.run_id
            self.deadline = now + timeout_s
        self.attempt_id = order.run_id
        self.provider_id = order.provider_id
        self.node_id = link.node_id
        self.target = order.target
        self.link = link
        self.unacknowledged = False
        self.answered = False
        self._started_ms = started_ms
        self._opened_at = self._last_event = now
        self._expires_at = now + timeout_s + grace_s
        self._acked = guards.ack_timeout_s <= 0  # nothing to wait for
        self._ack_timeout_s = ack_timeout_s = (
            guards.ack_timeout_s + len(order.body_json) / (1 << 20) * ACK_SECONDS_PER_MIB
        )
        self._ack_by = now + ack_timeout_s
        self._order_left = False  # ``order_sent`` says when it has
        stream = self.spec.stream
        self._stall_s = guards.stall_timeout_s if stream else 0.0
        self._first_token_s = guards.first_token_timeout_s if stream else 0.0
        self._awaiting_first = stream  # no delta yet: the first-token bound holds
        self._timer = self._loop.call_at(self._next_check(), self._check)

    def order_sent(self, attempt_id: str) -> None:
        """The attempt's order has left (its link's ``send_run`` returned): the node's
        acknowledgement is timed from now. The setting promises a bound "after it was
        sent", and a multi-MiB order takes a busy edge seconds to encode, encrypt and
        write: that time is the edge's own, and must not take its node out of selection.

        The timer armed at ``attempt`` is left as it is: it fires at or before the new
        bound, and ``_check`` re-arms it for what is then the earliest guard."""
        if self.attempt_id == attempt_id and self.link is not None:
            self._order_left = True
            self._ack_by = self._loop.time() + self._ack_timeout_s

    def deliver(self, event: RunEvent | Accepted) -> None:
        """An event of the attempt from its node. Any event is an acknowledgement;
        ``Accepted`` is nothing else, a start is the run's to keep (its node's queue
        wait): only deltas are queued for the reader, and the end is the outcome."""
        if self.link is None:
            return  # the attempt is over: a late event
        self._acked = True
        if self._stall_s:
            self._last_event = self._loop.time()
        if isinstance(event, Delta):
            self._awaiting_first = False
            self._events.append(event)
            self._wake()
            if not self.answered:  # the provider answers: its load, if any, is over
                self.answered = True
                self._owner.first_delta(self)
        elif isinstance(event, Started):
            self.node_wait_ms = event.queue_wait_ms
        elif isinstance(event, Completed):
            if event.start is not None:  # a folded completion: the start came with it
                self.node_wait_ms = event.start.queue_wait_ms
            self._attempt_over(event, told=True)
            self.end(event)
        elif isinstance(event, Failed):
            self._owner.provider_failed(self, event)
            self._attempt_failed(event, told=True)

    def fail(self, code: ErrorCode, message: str) -> None:
        """The attempt's node link is gone (its node dropped its runs with it)."""
        if self.link is not None:
            self._attempt_failed(Failed(code, message), told=True)

    def fail_send(self, failed: Failed) -> None:
        """The attempt's send failed: its node may have it (told to drop it)."""
        if self.link is not None:
            self._attempt_failed(failed, told=False)

    def unsent(self) -> None:
        """The attempt's frame never left (too large for the link): nothing to tell."""
        if self.link is not None:
            self._attempt_over(Failed(ErrorCode.INVALID_REQUEST, "not sent"), told=True)

    def _attempt_failed(self, failed: Failed, *, told: bool) -> None:
        """Retry before the first byte, else the run's end."""
        self._attempt_over(failed, told=told)
        if self._may_retry(failed):
            self._failed = failed
            self._wake()
        else:
            self.end(failed)

    def _may_retry(self, failed: Failed) -> bool:
        # A streamed run's first delta is its client's first byte: after it, no retry.
        return (
            self._retries > 0
            and self.outcome is None
            and not (self.spec.stream and not self._awaiting_first)
            and retryable(failed)
            and self._loop.time() < self.deadline
        )

    def _attempt_over(self, outcome: Completed | Failed, *, told: bool) -> None:
        link = self.link
        assert link is not None
        self.link = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not told:
            reason = outcome.message if isinstance(outcome, Failed) else "ended"
            self._untold = (link, self.attempt_id, reason)
        self._records.append(
            (
                self.attempt_id,
                self.provider_id,
                self.node_id,
                outcome,
                self._started_ms,
                self._loop.time() - self._opened_at,
            )
        )
        self._owner.attempt_over(self, outcome)
        self.slot = None

    async def _tell_node(self) -> None:
        untold, self._untold = self._untold, None
        if untold is not None:
            link, attempt_id, reason = untold
            # A node that is gone cancelled its runs with its connection already.
            with contextlib.suppress(ConnectionError):
                await link.send_cancel(attempt_id, reason)

    # ------------------------------------------------------------ the guards

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
        """The timer: fail the attempt for the first guard that passed, or re-arm."""
        self._timer = None
        if self.link is None:
            return
        now = self._loop.time()
        if not self._order_left and now >= self._ack_by:
            # Still being written: its node cannot have answered. Look again a timeout
            # later; once it has left, ``order_sent`` sets the bound.
            self._ack_by = now + self._ack_timeout_s
        if now >= self._expires_at:
            message = "the provider did not answer in time"
            self._attempt_failed(Failed(ErrorCode.PROVIDER_TIMEOUT, message), told=False)
        elif not self._acked and now >= self._ack_by:
            self.unacknowledged = True
            within = f"{self._ack_timeout_s:.3g}"
            message = f"node {self.node_id} did not acknowledge the run within {within} s"
            self._attempt_failed(Failed(ErrorCode.PROVIDER_UNAVAILABLE, message), told=False)
        elif self._awaiting_first and (
            self._first_token_s and now - self._opened_at >= self._first_token_s
        ):
            message = f"no first token within {self._first_token_s:g} s"
            self._attempt_failed(Failed(ErrorCode.PROVIDER_TIMEOUT, message), told=False)
        elif not self._awaiting_first and self._stall_s and now - self._last_event >= self._stall_s:
            message = f"no output for {self._stall_s:g} s"
            self._attempt_failed(Failed(ErrorCode.PROVIDER_TIMEOUT, message), told=False)
        else:
            self._timer = self._loop.call_at(self._next_check(), self._check)

    # ------------------------------------------------------------ the reader

    def _wake(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def next_events(self) -> Sequence[RunEvent]:
        """Implements ``RunEvents.next_events``: one reader takes what arrived, the
        outcome last; a failed attempt's next one is opened here (the reader's task)."""
        events = self._events
        while not events:
            if self.outcome is not None:
                if self._iterated:
                    return ()
                self._iterated = True  # the outcome is the last event anyone sees
                if self._untold is not None:
                    await self._tell_node()
                return (self.outcome,)
            if self._failed is not None:
                return await self._fail_over(self._failed)
            self._reader = self._loop.create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        self._events = deque()  # what arrives from now on is the next call's
        return events

    async def _fail_over(self, failed: Failed) -> Sequence[RunEvent]:
        """The next attempt, announced by ``Retrying``; the run's end when no other
        provider can take it in time."""
        self._failed = None
        if self._untold is not None:
            await self._tell_node()
        last = self.provider_id
        self._retries -= 1
        self.exclude = self.exclude | {last}
        self._last_failure = failed
        try:
            await self._owner.reopen(self, failed)
        except EdgeError as exc:
            self.refuse(exc)  # nobody else, or no room in time
            return await self.next_events()
        finally:
            self._last_failure = None
        return (Retrying(failed, last),)

    # ------------------------------------------------------------ the record

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        """Each attempt so far, oldest first; one still on its node is ``running``."""
        attempts = self._records
        if self.link is not None:
            live = self._loop.time() - self._opened_at
            attempt = (self.attempt_id, self.provider_id, self.node_id)
            attempts = [*attempts, (*attempt, None, self._started_ms, live)]
        records = []
        for attempt_id, provider_id, node_id, outcome, started_ms, seconds in attempts:
            if outcome is None:
                state, code = "running", ""
            elif isinstance(outcome, Completed):
                state, code = "completed", ""
            else:
                cancelled = outcome.code is ErrorCode.CANCELLED
                state, code = ("cancelled" if cancelled else "failed"), outcome.code.value
            records.append(
                AttemptRecord(
                    run_id=attempt_id,
                    provider_id=provider_id,
                    node_id=node_id,
                    outcome=state,
                    error_code=code,
                    started_ms=started_ms,
                    duration_ms=max(1, round(seconds * 1000)),
                )
            )
        return tuple(records)
