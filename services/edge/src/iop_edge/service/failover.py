"""Failover before the first byte (docs/ARCHITECTURE.md#failover): one request, its attempts.

A run that fails with a retryable error (``faults.retryable``) before anything was
written to its client runs again on another provider of its model, never on one that
already failed for it, up to the model's ``retries`` and within the first attempt's
deadline. "Before anything was written" is, for a streamed run, until its first delta
reaches the reader (the SSE status line leaves with it); for a non-streamed run, until
its end, since its answer is written only then: the reader is handed a ``Retrying``
event and drops the deltas it kept. After the first byte a failure is the client's, as
an SSE ``error`` event.

``FailoverRun`` is what the HTTP layer and batch lines read: one ``RunEvents`` however
many attempts it takes, under the first attempt's run id. Each attempt is an ``EdgeRun``
with a run id of its own (a node that failed a run is never asked to run that id
again), and takes and gives back its slot as any run does. The next attempt is opened in
the reader's own task, inside ``__anext__``: no task per request, and the body encoded
once (``RunBody``) serves every attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

from iop_edge.domain.events import Delta, ErrorCode, Failed, Retrying, RunEvent
from iop_edge.domain.faults import retryable
from iop_edge.errors import EdgeError
from iop_edge.ports import AttemptRecord, RunSpec
from iop_edge.service.limits import RunBody
from iop_edge.service.runs import EdgeRun


class Reopener(Protocol):
    """Opens a run's next attempt (``Dispatcher.reopen``)."""

    async def reopen(
        self,
        spec: RunSpec,
        body: RunBody,
        exclude: frozenset[str],
        deadline: float,
        failed: EdgeRun,
    ) -> EdgeRun:
        """Another provider of the model, none of ``exclude``, started by ``deadline``
        (the loop's clock), maybe after a wait in the model's queue; raises an
        ``EdgeError`` when there is none."""
        ...


class FailoverRun:
    """Implements ``RunEvents`` over a request's attempts (see the module's docstring)."""

    __slots__ = (
        "_attempt",
        "_attempts",
        "_body",
        "_cancelled",
        "_deadline",
        "_exclude",
        "_reopener",
        "_reopening",
        "_retries",
        "_settled",
        "_spec",
        "run_id",
    )

    def __init__(
        self, reopener: Reopener, spec: RunSpec, body: RunBody, first: EdgeRun, retries: int
    ) -> None:
        self.run_id = first.run_id
        self._reopener = reopener
        self._spec = spec
        self._body = body
        self._attempt = first
        self._attempts = [first]
        self._retries = retries
        self._deadline = first.deadline  # the request's: no attempt runs past it
        self._exclude: frozenset[str] = frozenset()
        self._cancelled: str | None = None
        self._reopening: asyncio.Task[object] | None = None
        # Settled: no failover can come any more (the first byte is out, or no retry is
        # left), so events pass straight from the attempt, at no cost per event.
        self._settled = retries <= 0

    @property
    def attempt(self) -> EdgeRun:
        """The attempt in progress (or the last one): where the node's events go."""
        return self._attempt

    @property
    def provider_id(self) -> str:
        return self._attempt.provider_id

    @property
    def node_id(self) -> str:
        return self._attempt.node_id

    @property
    def target(self) -> str:
        return self._attempt.target

    @property
    def more_ready(self) -> bool:
        return self._attempt.more_ready

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        attempts = self._attempts
        if len(attempts) == 1:  # nearly always
            return (attempts[0].record(),)
        return tuple(attempt.record() for attempt in attempts)

    def __aiter__(self) -> FailoverRun:
        return self

    def __anext__(self) -> Awaitable[RunEvent]:
        if self._settled:
            return self._attempt.__anext__()
        return self._next()

    async def _next(self) -> RunEvent:
        event = await self._attempt.__anext__()
        if type(event) is Delta:
            if self._spec.stream:
                self._settled = True  # this delta is the client's first byte
            return event
        if type(event) is Failed and self._may_retry(event):
            return await self._fail_over(event)
        return event

    def _may_retry(self, failed: Failed) -> bool:
        return (
            self._retries > 0
            and self._cancelled is None
            and retryable(failed)
            and asyncio.get_running_loop().time() < self._deadline
        )

    async def _fail_over(self, failed: Failed) -> RunEvent:
        """The next attempt, announced by ``Retrying``; ``failed`` itself (the run's end)
        when no other provider can take it in time."""
        last = self._attempt
        self._retries -= 1
        self._exclude = self._exclude | {last.provider_id}
        task = asyncio.current_task()
        self._reopening = task
        try:
            attempt = await self._reopener.reopen(
                self._spec, self._body, self._exclude, self._deadline, last
            )
        except EdgeError:
            return failed  # nobody else (or no room in time): the client gets what it got
        except asyncio.CancelledError:
            # ``cancel`` stopped the wait; a cancellation from elsewhere goes on up.
            if self._cancelled is not None and task is not None and task.uncancel() == 0:
                return Failed(ErrorCode.CANCELLED, self._cancelled)
            raise
        finally:
            self._reopening = None
        self._attempt = attempt
        self._attempts.append(attempt)
        self._settled = self._retries <= 0
        return Retrying(failed, last.provider_id)

    async def cancel(self, reason: str) -> None:
        """Stop the run: the attempt in progress is cancelled on its node; a next attempt
        still being opened (waiting for a slot) is given up."""
        first = self._cancelled is None
        if first:
            self._cancelled = reason
        task = self._reopening
        if task is not None:
            if first and task is not asyncio.current_task():
                task.cancel()  # the reader's own task, waiting in ``reopen``
            return
        await self._attempt.cancel(reason)
