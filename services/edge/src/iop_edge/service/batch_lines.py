"""One batch line through the edge's normal dispatch, at batch priority.

A line ends in one of two ways. Final: the model answered, or the request
itself failed (unknown model, too large, a provider error, a failure in the
edge): the result is stored and goes to the output or error file, as OpenAI
reports it. Transient: the fleet had no
room for it (queue full, queue timeout, no provider available) or the run was
cancelled from the edge's side (edge stopping, batch cancelled, worker gone):
nothing is stored, the line stays pending and runs again later. A batch line
waits behind every interactive request, so under load it may time out in the
queue; that must delay the batch, never fail its lines. A line whose run is preempted
(its slot given to an interactive request: ``service/backfill.py``) goes back in the
queue here, at once; nothing of the cancelled run was stored.

The OpenAI wire shapes come from the HTTP layer's pure formatting modules, so a
line's body is exactly what the same request would have returned over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from iop_edge.domain.batches import DONE, ENDPOINTS, LINE_FAILED, LineRecord, LineResult
from iop_edge.domain.drills import asks_drill
from iop_edge.domain.events import Completed, Usage
from iop_edge.domain.queue import Share
from iop_edge.errors import (
    EdgeError,
    InvalidRequest,
    ModelNotFound,
    NoProviderAvailable,
    Preempted,
    ProviderFailed,
    QueueFull,
    QueueTimeout,
)
from iop_edge.formats.errors import error_payload, internal_error
from iop_edge.formats.openai import RENDER_OFFLOAD_BYTES, dumps, render_result
from iop_edge.ports import Catalog, EdgeRunRecord, RunEvents, RunService, RunSpec
from iop_edge.service.key_rates import LineBudget
from iop_edge.service.line_trace import LineTrace
from iop_edge.service.run_reader import Collector, follow
from iop_proto.service.logging import log_unexpected

_TRANSIENT = (QueueFull, QueueTimeout, NoProviderAvailable)
_NOT_FORWARDED = ("stream", "stream_options")  # a batch line is never streamed


@dataclass(frozen=True, slots=True)
class LineOutcome:
    result: LineResult
    transient: bool  # not stored: the line stays pending and is run again


Account = Callable[[EdgeRunRecord], None]
"""Where a line's run is recorded when it ends: the run log and the request metrics."""


class LineRunner:
    """Runs lines and knows which runs are in flight, so a batch that ends can stop them."""

    def __init__(
        self,
        runs: RunService,
        catalog: Catalog,
        clock: Callable[[], float],
        budget: LineBudget | None = None,
        account: Account | None = None,
    ) -> None:
        """``budget``: lines count against their owner's token budget (none: they don't).
        ``account``: each line's run, once ended (``LineTrace``); none: not recorded."""
        self._runs = runs
        self._catalog = catalog
        self._clock = clock
        self._budget = budget
        self._account = account
        self._live: dict[str, set[RunEvents]] = {}  # batch id -> its lines' runs

    async def run(
        self, endpoint: str, line: LineRecord, result_id: str, owner: str | None = None
    ) -> LineOutcome:
        """Dispatch the line and wait for its end; never raises an ``EdgeError``.
        ``owner``: the batch's key (a key id), whose turn the line takes among batch
        lines, in whose token budget it counts, and under which each try is accounted
        for, on every way out.

        The line's run is known to its batch from admission on, before it waits for a
        slot: a batch that ends meanwhile ends it wherever it is (``cancel_batch``). A
        preempted run is dispatched again, as a new run, until the line has an end."""
        while True:
            trace = LineTrace(owner or "")
            try:
                outcome = await self._budgeted(endpoint, line, result_id, owner or "", trace)
            finally:
                if self._account is not None:
                    try:  # synchronous: a worker gone (a cancellation) cannot cut it short
                        self._account(trace.record())
                    except Exception as exc:
                        log_unexpected(
                            exc, "batch {} line {}: not recorded", line.batch_id, line.index
                        )
            if outcome is not None:
                return outcome

    async def _budgeted(
        self, endpoint: str, line: LineRecord, result_id: str, owner: str, trace: LineTrace
    ) -> LineOutcome | None:
        """One try within the owner's budget: admitted against it, and settled with the
        run's real usage (an estimate given back when it never completed); ``None``: it
        was preempted, and must run again."""
        try:
            trace.spec = spec = self._spec(endpoint, line, owner)
            meter = await self._budget.admit(owner, spec.model, spec.body) if self._budget else None
        except EdgeError as exc:
            trace.failed(exc)
            return _failure(exc, "", result_id)
        except Exception as exc:
            # Per-line boundary: a line the edge cannot run fails alone, into the error
            # file; left pending it would hold up its batch.
            log_unexpected(exc, "batch {} line {} could not be run", line.batch_id, line.index)
            return _failure(internal_error(), "", result_id)
        if meter is None:
            return await self._run_once(spec, line, result_id, trace)
        try:
            return await self._run_once(spec, line, result_id, trace)
        finally:
            if trace.end is None:  # never completed: its input estimate is given back
                meter.settle(0, 0, ran=False)
            else:
                done = trace.end.usage or Usage()
                meter.settle(done.prompt_tokens, done.completion_tokens, ran=True)
            await meter.close()

    async def _run_once(
        self, spec: RunSpec, line: LineRecord, result_id: str, trace: LineTrace
    ) -> LineOutcome | None:
        """One run of the line; ``None``: it was preempted, and must run again."""
        try:
            trace.run = run = self._runs.admit(spec)
        except EdgeError as exc:
            trace.failed(exc)
            return _failure(exc, "", result_id)
        except Exception as exc:
            log_unexpected(exc, "batch {} line {} could not be run", line.batch_id, line.index)
            return _failure(internal_error(), "", result_id)
        live = self._live.setdefault(line.batch_id, set())
        live.add(run)
        try:
            await run.open()  # at batch priority, maybe after a wait in the queue
            trace.opened()
            body = await self._collect(spec, run, trace)
        except Preempted as exc:
            trace.failed(exc)
            return None
        except EdgeError as exc:
            trace.failed(exc)
            return _failure(exc, run.run_id, result_id)
        except asyncio.CancelledError:
            # The worker is gone (its connection dropped): free the provider slot.
            trace.abandoned()
            await asyncio.shield(run.cancel("the batch line was abandoned"))
            raise
        except Exception as exc:
            # Per-line boundary: one line's bug must not take the worker's session down.
            log_unexpected(exc, "batch {} line {} failed in the edge", line.batch_id, line.index)
            trace.crashed()
            await asyncio.shield(run.cancel("edge failed"))
            return _failure(internal_error(), run.run_id, result_id)
        finally:
            live.discard(run)
            if not live and self._live.get(line.batch_id) is live:
                del self._live[line.batch_id]
        result = LineResult(DONE, 200, body, None, run.run_id, result_id)
        return LineOutcome(result, transient=False)

    async def cancel_batch(self, batch_id: str, reason: str) -> None:
        """End the runs of a batch that is ending, dispatched or still waiting for a
        slot; their lines stay unfinished (transient)."""
        for run in list(self._live.get(batch_id, ())):
            await run.cancel(reason)

    def _spec(self, endpoint: str, line: LineRecord, owner: str) -> RunSpec:
        body = json.loads(line.body_json)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("You must provide a model parameter (a string).", param="model")
        if self._catalog.model(model) is None:
            raise ModelNotFound(
                f"The model '{model}' does not exist or you do not have access to it.",
                param="model",
            )
        for name in _NOT_FORWARDED:
            body.pop(name, None)
        return RunSpec(
            model=model,
            operation=ENDPOINTS[endpoint],
            body=body,
            stream=False,
            include_usage=False,
            batch=True,
            share=Share(key=owner),
            drill=asks_drill(body),  # refused at the batch's creation unless allowed then
        )

    async def _collect(self, spec: RunSpec, run: RunEvents, trace: LineTrace) -> str:
        """The run's OpenAI response body (public model id), or its error raised."""
        collector = Collector()
        end = await follow(run, collector)
        if end is None:
            raise ProviderFailed("the run ended without a result")
        if not isinstance(end, Completed):
            raise run.error(end)
        trace.completed(end)
        render = functools.partial(
            render_result,
            spec.operation,
            end,
            collector.deltas,
            run_id=run.run_id,
            model=spec.model,
            created=int(self._clock()),
        )
        if len(end.result_json) > RENDER_OFFLOAD_BYTES:
            return (await asyncio.to_thread(render)).decode()  # megabytes of embeddings
        return render().decode()


def _failure(exc: EdgeError, request_id: str, result_id: str) -> LineOutcome:
    transient = isinstance(exc, _TRANSIENT) or exc.code == "cancelled"
    result = LineResult(
        LINE_FAILED, exc.status, None, dumps(error_payload(exc)), request_id, result_id
    )
    return LineOutcome(result, transient)
