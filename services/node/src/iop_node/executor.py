"""The node's common execution wrapper: admission, the adapter call, one terminal event, history.

Every run goes through ``execute_run`` whatever its provider type, so capacity,
queueing, deadlines, error codes and history are the same for all adapters.
Whatever ends a run (result, failure, deadline, cancellation), its slot or
queue place is released and exactly one terminal event is attempted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Final

from loguru import logger

from iop_node.domain.admission import Ungated
from iop_node.domain.health import Health
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    InvalidRequest,
    ProviderTimeout,
    ProviderUnavailable,
    QueueFull,
    QueueTimeout,
    RunCancelled,
    RunFailure,
)
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, EventSink, RunChannel, RunHistory, RunRecord, TokenCounter
from iop_node.runtime import ProviderRuntime
from iop_proto.prefix import body_blocks
from iop_proto.v1 import runtime_pb2 as pb

ChangeCallback = Callable[[], None]
PROMPTED: Final = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})
"""The operations whose prompt an engine caches (``ProviderRuntime.cache``)."""
NOT_IMPLEMENTED: Final = 501
"""The provider status of an operation a provider does not offer (the edge's word for it)."""


def _code_name(code: int) -> str:
    """History and metrics name codes as the edge's errors do: ``queue_full``, ``cancelled``."""
    return pb.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()


def _unix_ms() -> int:
    return time.time_ns() // 1_000_000  # one builtin call, not time() and int()


def _us_since(began: float) -> int:
    return int((time.perf_counter() - began) * 1_000_000)


class _FirstTokenSink:
    """Passes deltas to the channel and notes when the first one went out; the first
    carries the wait on the provider up to it (``Delta.provider_us``)."""

    def __init__(self, channel: RunChannel) -> None:
        self._channel = channel
        self.first_token_ms = 0
        self.provider_began = 0.0  # perf_counter() when the adapter was called

    async def delta(self, delta: Delta) -> None:
        if not self.first_token_ms:
            self.first_token_ms = _unix_ms()
            delta = dataclasses.replace(delta, provider_us=_us_since(self.provider_began))
        await self._channel.delta(delta)


def _call(adapter: Adapter, spec: ExecutionSpec, sink: EventSink) -> Awaitable[Completion]:
    """The adapter's call for the run's operation: ``count_tokens`` goes to its tokenizer."""
    if spec.operation is not Operation.COUNT_TOKENS:
        return adapter.execute(spec, sink)
    if isinstance(adapter, TokenCounter):
        return adapter.count_tokens(spec)
    # 501: the edge stops choosing this provider for the operation (and fails over)
    raise InvalidRequest(
        f"provider {spec.provider_id} ({adapter.name}) has no tokenizer to count tokens with",
        provider_status=NOT_IMPLEMENTED,
    )


class RunExecutor:
    """Runs requests on providers; owns nothing but references to shared services."""

    def __init__(
        self, history: RunHistory, metrics: NodeMetrics, on_change: ChangeCallback
    ) -> None:
        self._history = history
        self._metrics = metrics
        self._on_change = on_change

    async def execute_run(
        self, runtime: ProviderRuntime, spec: ExecutionSpec, channel: RunChannel
    ) -> None:
        """Run ``spec`` to its end. Raises only ``CancelledError`` (after cleaning up)."""
        loop = asyncio.get_running_loop()
        received_ms = _unix_ms()
        started_ms = 0
        sink = _FirstTokenSink(channel)
        outcome, code, message, completion = "failed", "", "", None
        slot_taken_at: float | None = None
        adapter = runtime.adapter  # a config change must not swap it mid-run
        queue_timeout_s = min(runtime.config.queue_timeout_ms / 1000, spec.deadline - loop.time())
        try:
            admission = (
                Ungated()
                if spec.operation is Operation.COUNT_TOKENS
                else runtime.gate.admit(max(queue_timeout_s, 0.0))
            )
            self._on_change()  # queued may have grown
            async with admission:
                slot_taken_at = loop.time()
                self._on_change()
                metrics = self._metrics
                metrics.child(metrics.queue_wait, spec.provider_id).observe(admission.queue_wait_s)
                started_ms = _unix_ms()
                await self._history.run_started(
                    _record(spec, "running", received_ms=received_ms, started_ms=started_ms)
                )
                await channel.started(
                    spec.provider_id, spec.target, int(admission.queue_wait_s * 1000)
                )
                sink.provider_began = time.perf_counter()
                try:
                    async with asyncio.timeout_at(spec.deadline):
                        completion = await _call(adapter, spec, sink)
                    if not completion.provider_us:
                        completion = dataclasses.replace(
                            completion, provider_us=_us_since(sink.provider_began)
                        )
                except TimeoutError:
                    raise ProviderTimeout(
                        f"provider {spec.provider_id} did not finish before the deadline"
                    ) from None
                # Before the slot is let go: every snapshot that shows the run ended shows
                # its prompt cached too, so the edge routes the conversation's next turn
                # here from the first snapshot it gets after the answer.
                if spec.operation in PROMPTED:
                    _account(runtime, spec, completion)
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
            code, message = _code_name(failure.code), failure.message
            if isinstance(failure, ProviderUnavailable):
                self._mark_unavailable(runtime, failure.message)
            waited = _us_since(sink.provider_began) if sink.provider_began else 0
            await self._fail_quietly(
                channel, failure.code, failure.message, failure.provider_status, waited, failure
            )
        except asyncio.CancelledError as cancel:
            # The canceller's reason (``NodeCore.cancel``), or a plain "cancelled".
            reason = str(cancel) or "cancelled"
            outcome, code, message = "cancelled", _code_name(pb.ERROR_CODE_CANCELLED), reason
            with contextlib.suppress(BaseException):
                await asyncio.shield(
                    self._fail_quietly(channel, pb.ERROR_CODE_CANCELLED, "run cancelled", 0)
                )
            raise
        except Exception as exc:
            logger.exception("run {} on {} failed unexpectedly", spec.run_id, spec.provider_id)
            outcome, code, message = (
                "failed",
                _code_name(pb.ERROR_CODE_INTERNAL),
                f"internal error: {exc}",
            )
            await self._fail_quietly(channel, pb.ERROR_CODE_INTERNAL, message, 0)
        finally:
            await self._finish(
                runtime, spec, received_ms, started_ms, outcome, code, message, completion, sink
            )
            if slot_taken_at is not None:
                metrics = self._metrics
                metrics.child(metrics.service_time, spec.provider_id).observe(
                    loop.time() - slot_taken_at
                )
            self._on_change()

    async def _fail_quietly(
        self,
        channel: RunChannel,
        code: int,
        message: str,
        provider_status: int,
        provider_us: int = 0,
        failure: RunFailure | None = None,
    ) -> None:
        """The edge may be gone already: a failed error report changes nothing."""
        with contextlib.suppress(RunCancelled, ConnectionError, OSError):
            await channel.failed(
                code,
                message,
                provider_status,
                provider_us,
                context_window=failure.context_window if failure else 0,
                prompt_tokens=failure.prompt_tokens if failure else 0,
            )

    def _mark_unavailable(self, runtime: ProviderRuntime, detail: str) -> None:
        runtime.cache.forget()  # the engine is not there: nor is its cache
        if runtime.health.mark_unavailable(detail):
            logger.warning("provider {} unavailable: {}", runtime.config.id, detail)
            runtime.publish(self._metrics)
        assert runtime.health.state is Health.UNAVAILABLE

    async def _finish(
        self,
        runtime: ProviderRuntime,
        spec: ExecutionSpec,
        received_ms: int,
        started_ms: int,
        outcome: str,
        code: str,
        message: str,
        completion: Completion | None,
        sink: _FirstTokenSink,
    ) -> None:
        usage = completion.usage if completion else None
        final = _record(
            spec,
            outcome,
            error_code=code,
            error_message=message[:500],
            received_ms=received_ms,
            started_ms=started_ms,
            first_token_ms=sink.first_token_ms,
            finished_ms=_unix_ms(),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
        )
        # complete_run only queues the record (the store writes in batches off the
        # request path), so awaiting it here, even while cancelling, costs nothing.
        await self._history.complete_run(final)
        metrics, provider_id = self._metrics, spec.provider_id
        metrics.child(metrics.runs, provider_id, outcome, code or "ok").inc()
        if usage:
            prompt_tokens, completion_tokens, cached_tokens = metrics.tokens_of(provider_id)
            prompt_tokens.inc(usage.prompt_tokens)
            completion_tokens.inc(usage.completion_tokens)
            cached_tokens.inc(usage.cached_tokens)
        runtime.publish_load(metrics)  # the health, if this run changed it, is published


def _account(runtime: ProviderRuntime, spec: ExecutionSpec, completion: Completion) -> None:
    """Note a served prompt in the provider's cache account. Hashed here, on the event
    loop: the hashing is linear in the prompt and bounded (``iop_proto.prefix.MAX_BLOCKS``),
    a small fraction of what the engine spent reading the same prompt."""
    usage = completion.usage or Usage()  # no usage: the prompt is kept, nothing counted
    runtime.cache.served(
        body_blocks(spec.body),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        prefill_ms_per_token=usage.prefill_ms_per_token,
    )


def _record(
    spec: ExecutionSpec,
    outcome: str,
    *,
    error_code: str = "",
    error_message: str = "",
    received_ms: int,
    started_ms: int,
    first_token_ms: int = 0,
    finished_ms: int = 0,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
) -> RunRecord:
    """The history record of ``spec`` at one point of its life (built whole: it is frozen)."""
    return RunRecord(
        run_id=spec.run_id,
        model=spec.model,
        provider_id=spec.provider_id,
        target=spec.target,
        operation=spec.operation.value,
        stream=spec.stream,
        outcome=outcome,
        error_code=error_code,
        error_message=error_message,
        received_ms=received_ms,
        started_ms=started_ms,
        first_token_ms=first_token_ms,
        finished_ms=finished_ms,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )
