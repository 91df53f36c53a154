"""Conversions between the edge's plain values and the protobuf contract (the one place).

Run events in (``run_event``, with the provider's load a run's end carries), run orders
out (``run_request``), snapshots in (``provider_reports``, ``cache_report``), batch
answers out (``lease_grant``, ``line_result``). A run event becomes one plain event of
the kind the message holds (``WhichOneof``); the delta's text is the string the message
gave, not copied.
"""

from __future__ import annotations

from collections.abc import Iterable

from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.events import (
    ACCEPTED,
    Accepted,
    Completed,
    Delta,
    ErrorCode,
    Failed,
    ProviderLoad,
    ProviderReport,
    RunEvent,
    RunOrder,
    Started,
    ToolCallDelta,
    Usage,
)
from iop_edge.domain.fleet import Operation
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, UNKNOWN
from iop_edge.domain.warmth import LoadReport, LoadTime
from iop_proto.v1 import runtime_pb2 as pb

_OPERATIONS = {
    Operation.CHAT_COMPLETIONS: pb.OPERATION_CHAT_COMPLETIONS,
    Operation.COMPLETIONS: pb.OPERATION_COMPLETIONS,
    Operation.EMBEDDINGS: pb.OPERATION_EMBEDDINGS,
    Operation.COUNT_TOKENS: pb.OPERATION_COUNT_TOKENS,
}
_HEALTH = {pb.HEALTH_AVAILABLE: AVAILABLE, pb.HEALTH_UNAVAILABLE: UNAVAILABLE}
_CODES = {
    pb.ERROR_CODE_INVALID_REQUEST: ErrorCode.INVALID_REQUEST,
    pb.ERROR_CODE_NOT_FOUND: ErrorCode.NOT_FOUND,
    pb.ERROR_CODE_QUEUE_FULL: ErrorCode.QUEUE_FULL,
    pb.ERROR_CODE_QUEUE_TIMEOUT: ErrorCode.QUEUE_TIMEOUT,
    pb.ERROR_CODE_PROVIDER_UNAVAILABLE: ErrorCode.PROVIDER_UNAVAILABLE,
    pb.ERROR_CODE_PROVIDER_ERROR: ErrorCode.PROVIDER_ERROR,
    pb.ERROR_CODE_PROVIDER_TIMEOUT: ErrorCode.PROVIDER_TIMEOUT,
    pb.ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    pb.ERROR_CODE_CANCELLED: ErrorCode.CANCELLED,
    pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorCode.CONTEXT_LENGTH_EXCEEDED,
}


def run_event(event: pb.RunEvent) -> RunEvent | Accepted | None:
    """The node's event as the edge's (``ACCEPTED`` for its acknowledgement); ``None``
    for one without a body (nothing to say)."""
    kind = event.WhichOneof("kind")
    if kind == "delta":
        d = event.delta
        usage = None
        if d.HasField("usage"):  # the last delta of a stream that asked for it
            u = d.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens)
        return Delta(
            d.text,
            d.choice_index,
            d.role,
            tuple(_tool_call(c) for c in d.tool_calls) if d.tool_calls else (),
            d.finish_reason,
            usage,
            d.reasoning_text,
            d.logprobs_json,
            d.provider_us,
        )
    if kind == "complete":
        c = event.complete
        usage = started = None
        if c.HasField("usage"):
            u = c.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens)
        if c.HasField("start"):  # a folded completion: the run's start rides along
            s = c.start
            started = Started(s.provider_id, s.target, s.queue_wait_ms)
        load = _load(c.load) if c.HasField("load") else None
        return Completed(c.finish_reason, usage, c.result_json, c.provider_us, started, load)
    if kind == "error":
        return failed(event.error)
    if kind == "start":
        s = event.start
        return Started(s.provider_id, s.target, s.queue_wait_ms)
    if kind == "accepted":
        return ACCEPTED
    return None


def failed(error: pb.RunError) -> Failed:
    """A run error: codes the edge does not tell apart are ``INTERNAL``; an error without
    a message is named by its wire code."""
    code = _CODES.get(error.code, ErrorCode.INTERNAL)
    return Failed(
        code,
        error.message or pb.ErrorCode.Name(error.code),
        error.provider_status,
        error.provider_us,
        error.context_window,
        error.prompt_tokens,
        _load(error.load) if error.HasField("load") else None,
    )


def _load(load: pb.ProviderLoad) -> ProviderLoad:
    return ProviderLoad(
        load.in_flight, load.queued, cache_report(load.cache) if load.HasField("cache") else None
    )


def run_request(order: RunOrder) -> pb.RunRequest:
    return pb.RunRequest(
        run_id=order.run_id,
        model=order.model,
        provider_id=order.provider_id,
        adapter=order.adapter,
        target=order.target,
        operation=_OPERATIONS[order.operation],
        body_json=order.body_json,
        stream=order.stream,
        deadline_unix_ms=order.deadline_unix_ms,
        include_usage=order.include_usage,
        body_prepared=order.body_prepared,
        prompt_blocks=order.prompt_blocks,
        traceparent=order.traceparent,
    )


def provider_reports(states: Iterable[pb.ProviderState]) -> list[ProviderReport]:
    return [
        ProviderReport(
            state.provider_id,
            _HEALTH.get(state.health, UNKNOWN),
            state.in_flight,
            state.queued,
            tuple(state.models),
            state.detail,
            {
                "list_models": state.capabilities.list_models,
                "load_model": state.capabilities.load_model,
                "unload_model": state.capabilities.unload_model,
                "pull_model": state.capabilities.pull_model,
                "delete_model": state.capabilities.delete_model,
            },
            cache_report(state.cache) if state.HasField("cache") else None,
            qualification_engine(state),
            load_report(state.loaded) if state.HasField("loaded") else None,
        )
        for state in states
    ]


def qualification_engine(state: pb.ProviderState) -> dict[str, str | int] | None:
    """The engine and device the node asked its provider's engine about (``None``: not yet,
    or an older node), for the catalog and qualification reports."""
    if not state.HasField("engine"):
        return None
    engine = state.engine
    return {
        "name": engine.name,
        "version": engine.version,
        "device": engine.device,
        "listed_models": engine.listed_models,
    }


def load_report(loaded: pb.LoadedModels) -> LoadReport:
    """An on-demand provider's memory (docs/ARCHITECTURE.md#warm-aware-scheduling)."""
    return LoadReport(
        {m.name: (m.since_unix_ms, m.expires_unix_ms) for m in loaded.models},
        {t.name: LoadTime(t.last_ms, t.mean_ms, t.loads) for t in loaded.timings},
        loaded.max_loaded,
    )


def cache_report(cache: pb.CacheState) -> CacheReport:
    """A provider's ``CacheState``: its prefixes keyed by their last block hash (the
    newest first, so a hash the node names twice keeps its newest length)."""
    held: dict[int, int] = {}
    for prefix in cache.prefixes:
        held.setdefault(prefix.tail, prefix.blocks)
    return CacheReport(
        held=held,
        prompt_tokens=cache.prompt_tokens,
        cached_tokens=cache.cached_tokens,
        prefill_ms_per_token=cache.prefill_ms_per_token or None,
    )


def lease_grant(grant: LeaseGrant) -> pb.LeaseGrant:
    return pb.LeaseGrant(
        batch_id=grant.batch_id,
        lease_id=grant.lease_id,
        expires_at_unix_ms=grant.expires_at_unix_ms,
        endpoint=grant.endpoint,
        next_line=grant.next_line,
        total_lines=grant.total_lines,
    )


def line_result(reply: LineReply) -> pb.BatchLineResult:
    return pb.BatchLineResult(
        lease_id=reply.lease_id,
        line_number=reply.line_number,
        custom_id=reply.custom_id,
        status_code=reply.status_code,
        response_json=reply.response_json,
        error_json=reply.error_json,
    )


def _tool_call(call: pb.ToolCallDelta) -> ToolCallDelta:
    return ToolCallDelta(
        call.index, call.id, call.type, call.function_name, call.function_arguments
    )
