"""The node's common execution wrapper: admission, the adapter call, one terminal event, history.

Every run goes through ``execute_run`` whatever its provider type, so capacity,
queueing, deadlines, error codes and history are the same for all adapters.
Whatever ends a run (result, failure, deadline, cancellation), its slot or
queue place is released and exactly one terminal event is attempted.

One deadline scope bounds the run, queue wait included, and the adapters open none
of their own: a run that finds a slot free has the scope end at its deadline; one
that must wait for a slot has it end at the earlier of the provider's queue timeout
and the deadline, moved to the deadline once it has the slot. Which of the two
ended it says the error: ``queue_timeout`` while queued, ``provider_timeout`` after.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Final

from loguru import logger

from iop_node.domain.events import Failed, Started
from iop_node.domain.health import Health
from iop_node.domain.runs import Completion, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    ErrorCode,
    InvalidRequest,
    ProviderTimeout,
    ProviderUnavailable,
    QueueFull,
    QueueTimeout,
    RunCancelled,
    RunFailure,
)
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, RunChannel, RunHistory, RunRecord, TokenCounter
from iop_node.runtime import ProviderRuntime
from iop_node.service.run_spans import RunTimes, record_run_spans
from iop_proto.prefix import body_blocks
from iop_proto.tracing import Tracing

ChangeCallback = Callable[[], None]
PROMPTED: Final = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})
"""The operations whose prompt an engine caches (``ProviderRuntime.cache``)."""
NOT_IMPLEMENTED: Final = 501
"""The provider status of an operation a provider does not offer (the edge's word for it)."""
_UNTRACED: Final = contextlib.nullcontext()  # an untraced run logs without run and trace ids


class RunExecutor:
    """Runs requests on providers; owns nothing but references to shared services."""

    def __init__(
        self,
        history: RunHistory,
        metrics: NodeMetrics,
        on_change: ChangeCallback,
        *,
        node_id: str = "",
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``: spans of the runs the edge traced (``run_spans``); ``None``: off."""
        self._history = history
        self._metrics = metrics
        self._on_change = on_change
        self._node_id = node_id
        self._tracing = tracing

    async def execute_run(
        self, runtime: ProviderRuntime, spec: ExecutionSpec, channel: RunChannel
    ) -> None:
        """Run ``spec`` to its end. Raises only ``CancelledError`` (after cleaning up).

        A run the edge traced, on a node that traces, logs with its run and trace ids
        (loguru's ``extra``) and leaves its spans (``run_spans``)."""
        traced = self._tracing is not None and bool(spec.traceparent)
        with (
            logger.contextualize(run_id=spec.run_id, trace_id=spec.traceparent[3:35])
            if traced
            else _UNTRACED
        ):
            loop = asyncio.get_running_loop()
            received_ns = time.time_ns()
            received_ms = received_ns // 1_000_000
            started_ms = 0
            outcome, code, message, completion = "failed", "", "", None
            adapter = runtime.adapter  # a config change must not swap it mid-run
            gate = None if spec.operation is Operation.COUNT_TOKENS else runtime.gate
            slot_taken_at: float | None = None
            provider_began = 0.0
            try:
                # count_tokens takes no slot: the engine's tokenizer answers beside its
                # generations. A free slot is taken here, before the scope: a run that has
                # it at once is bounded by its deadline alone.
                waits, queue_s = False, 0.0
                if gate is not None:
                    if gate.take_free():
                        slot_taken_at = loop.time()
                    else:
                        waits = True
                        queue_s = runtime.config.queue_timeout_ms / 1000
                        queue_s = max(min(queue_s, spec.deadline - loop.time()), 0.0)
                scope = asyncio.timeout_at(loop.time() + queue_s if waits else spec.deadline)
                try:
                    async with scope:
                        queue_wait_s = 0.0
                        if waits:
                            assert gate is not None
                            queue_wait_s = await gate.acquire()
                            slot_taken_at = loop.time()
                            scope.reschedule(spec.deadline)
                        if gate is not None:
                            metrics = self._metrics
                            metrics.child(metrics.queue_wait, spec.provider_id).observe(
                                queue_wait_s
                            )
                        started_ms = time.time_ns() // 1_000_000
                        self._history.run_started(
                            RunRecord(
                                spec.run_id,
                                spec.model,
                                spec.provider_id,
                                spec.target,
                                spec.operation.value,
                                spec.stream,
                                "running",
                                received_ms=received_ms,
                                started_ms=started_ms,
                            )
                        )
                        channel.started(
                            Started(spec.provider_id, spec.target, int(queue_wait_s * 1000))
                        )
                        provider_began = time.perf_counter()
                        if spec.operation is Operation.COUNT_TOKENS:
                            completion = await _count_tokens(adapter, spec)
                        else:
                            completion = await adapter.execute(spec, channel)
                        if not completion.provider_us:
                            provider_us = int((time.perf_counter() - provider_began) * 1_000_000)
                            completion = dataclasses.replace(completion, provider_us=provider_us)
                        # Before the slot is let go: the run's end (its load, or a snapshot)
                        # that shows the slot free shows the prompt cached too, so the edge
                        # routes the conversation's next turn here from that report on.
                        if spec.operation in PROMPTED:
                            served = completion.usage or Usage()  # none: the prompt is kept
                            blocks = spec.prompt_blocks
                            runtime.cache.served(
                                body_blocks(spec.body) if blocks is None else blocks,
                                prompt_tokens=served.prompt_tokens,
                                cached_tokens=served.cached_tokens,
                                prefill_ms_per_token=served.prefill_ms_per_token,
                            )
                except TimeoutError:
                    if not scope.expired():
                        raise  # the adapter's own (a RunFailure) or a bug: not this scope's
                    if waits and slot_taken_at is None:
                        raise QueueTimeout(
                            f"provider {spec.provider_id}: no slot free within"
                            f" {queue_s * 1000:.0f} ms"
                        ) from None
                    raise ProviderTimeout(
                        f"provider {spec.provider_id} did not finish before the deadline"
                    ) from None
                finally:
                    if slot_taken_at is not None:
                        assert gate is not None
                        gate.release()
                outcome = "completed"
                await channel.completed(completion)
            except RunFailure as failure:
                # RunCancelled: the edge went away while the run was sending. It is recorded as
                # a cancel (not a failure) so the same edge loss gives the same record whether
                # a run was sending (this) or waiting (the link's cancel, below).
                if isinstance(failure, RunCancelled):
                    outcome = "cancelled"
                elif isinstance(failure, QueueFull | QueueTimeout):
                    outcome = "rejected"
                else:
                    outcome = "failed"
                code, message = failure.code.value, failure.message
                if isinstance(failure, ProviderUnavailable):
                    self._mark_unavailable(runtime, failure.message)
                waited = int((time.perf_counter() - provider_began) * 1e6) if provider_began else 0
                await _fail_quietly(
                    channel,
                    Failed(
                        failure.code,
                        failure.message,
                        failure.provider_status,
                        waited,
                        failure.context_window,
                        failure.prompt_tokens,
                    ),
                )
            except asyncio.CancelledError as cancel:
                # The canceller's reason (``NodeCore.cancel``), or a plain "cancelled".
                outcome, code, message = "cancelled", ErrorCode.CANCELLED.value, str(cancel)
                message = message or "cancelled"
                with contextlib.suppress(BaseException):
                    await asyncio.shield(
                        _fail_quietly(channel, Failed(ErrorCode.CANCELLED, "run cancelled"))
                    )
                raise
            except Exception as exc:
                logger.exception("run {} on {} failed unexpectedly", spec.run_id, spec.provider_id)
                outcome, code = "failed", ErrorCode.INTERNAL.value
                message = f"internal error: {exc}"
                await _fail_quietly(channel, Failed(ErrorCode.INTERNAL, message))
            finally:
                usage = completion.usage if completion else None
                # complete_run only queues the record (the store writes in batches off the
                # request path): nothing here waits, even while cancelling.
                self._history.complete_run(
                    RunRecord(
                        spec.run_id,
                        spec.model,
                        spec.provider_id,
                        spec.target,
                        spec.operation.value,
                        spec.stream,
                        outcome,
                        code,
                        message[:500],
                        received_ms,
                        started_ms,
                        channel.first_token_ms,
                        time.time_ns() // 1_000_000,
                        usage.prompt_tokens if usage else 0,
                        usage.completion_tokens if usage else 0,
                        usage.cached_tokens if usage else 0,
                    )
                )
                metrics, provider_id = self._metrics, spec.provider_id
                metrics.child(metrics.runs, provider_id, outcome, code or "ok").inc()
                if usage:
                    tokens = metrics.tokens
                    metrics.child(tokens, provider_id, "prompt").inc(usage.prompt_tokens)
                    metrics.child(tokens, provider_id, "completion").inc(usage.completion_tokens)
                    metrics.child(tokens, provider_id, "cached").inc(usage.cached_tokens)
                if slot_taken_at is not None:
                    service_time = metrics.child(metrics.service_time, provider_id)
                    service_time.observe(loop.time() - slot_taken_at)
                if self._tracing is not None and spec.traceparent:
                    ended_ns = time.time_ns()
                    began_ns = 0
                    if provider_began:  # on the perf clock: placed on the wall clock from the end
                        began_ns = ended_ns - int((time.perf_counter() - provider_began) * 1e9)
                    times = RunTimes(received_ns, began_ns, channel.first_token_ms, ended_ns)
                    record_run_spans(
                        self._tracing,
                        spec,
                        self._node_id,
                        times,
                        outcome=outcome,
                        code=code,
                        usage=usage,
                    )

    def _mark_unavailable(self, runtime: ProviderRuntime, detail: str) -> None:
        runtime.cache.forget()  # the engine is not there: nor is its cache
        if runtime.health.mark_unavailable(detail):
            logger.warning("provider {} unavailable: {}", runtime.config.id, detail)
            runtime.publish(self._metrics)
            self._on_change()  # health: the edge hears of it in a snapshot
        assert runtime.health.state is Health.UNAVAILABLE


async def _count_tokens(adapter: Adapter, spec: ExecutionSpec) -> Completion:
    """``count_tokens`` goes to the adapter's tokenizer, where it has one."""
    if isinstance(adapter, TokenCounter):
        return await adapter.count_tokens(spec)
    # 501: the edge stops choosing this provider for the operation (and fails over)
    raise InvalidRequest(
        f"provider {spec.provider_id} ({adapter.name}) has no tokenizer to count tokens with",
        provider_status=NOT_IMPLEMENTED,
    )


async def _fail_quietly(channel: RunChannel, failure: Failed) -> None:
    """The edge may be gone already: a failed error report changes nothing."""
    with contextlib.suppress(RunCancelled, ConnectionError, OSError):
        await channel.failed(failure)
