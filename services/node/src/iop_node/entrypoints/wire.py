"""Conversions between the node's domain types and the protobuf contract (the one place).

In: provider configs and run orders (``run_order``). Out: provider states and a run's
events (``run_event``: the executor's domain events, a run's end with its provider's
load, ``provider_load``), with the error codes' wire numbers.
Nothing else in the node imports ``iop_proto.v1``.
"""

from __future__ import annotations

import json
from typing import Any

from iop_node.domain.cache_account import CacheView
from iop_node.domain.events import RunEvent, Started
from iop_node.domain.health import Health
from iop_node.domain.model_load import LoadState
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, Operation, RunOrder, Usage
from iop_node.errors import ErrorCode
from iop_node.service.providers import ProviderStatus
from iop_proto import json_codec
from iop_proto.v1 import runtime_pb2 as pb

_HEALTH = {
    Health.UNKNOWN: pb.HEALTH_UNKNOWN,
    Health.AVAILABLE: pb.HEALTH_AVAILABLE,
    Health.UNAVAILABLE: pb.HEALTH_UNAVAILABLE,
}
_CATEGORY_FROM_PB = {
    pb.PROVIDER_CATEGORY_API: "api",
    pb.PROVIDER_CATEGORY_CLI: "cli",
    pb.PROVIDER_CATEGORY_LOCAL_INFERENCE: "local_inference",
}
_CATEGORY_TO_PB = {name: value for value, name in _CATEGORY_FROM_PB.items()}
_OPERATIONS = {
    pb.OPERATION_CHAT_COMPLETIONS: Operation.CHAT_COMPLETIONS,
    pb.OPERATION_COMPLETIONS: Operation.COMPLETIONS,
    pb.OPERATION_EMBEDDINGS: Operation.EMBEDDINGS,
    pb.OPERATION_COUNT_TOKENS: Operation.COUNT_TOKENS,
}
_CODES: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: pb.ERROR_CODE_INVALID_REQUEST,
    ErrorCode.NOT_FOUND: pb.ERROR_CODE_NOT_FOUND,
    ErrorCode.QUEUE_FULL: pb.ERROR_CODE_QUEUE_FULL,
    ErrorCode.QUEUE_TIMEOUT: pb.ERROR_CODE_QUEUE_TIMEOUT,
    ErrorCode.PROVIDER_UNAVAILABLE: pb.ERROR_CODE_PROVIDER_UNAVAILABLE,
    ErrorCode.PROVIDER_ERROR: pb.ERROR_CODE_PROVIDER_ERROR,
    ErrorCode.PROVIDER_TIMEOUT: pb.ERROR_CODE_PROVIDER_TIMEOUT,
    ErrorCode.CANCELLED: pb.ERROR_CODE_CANCELLED,
    ErrorCode.INTERNAL: pb.ERROR_CODE_INTERNAL,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
}


def run_order(request: pb.RunRequest) -> RunOrder:
    """The edge's run request as the node's order (an unknown operation is ``None``:
    the run fails as an invalid request, not the link)."""
    prepared = request.body_prepared
    return RunOrder(
        run_id=request.run_id,
        model=request.model,
        provider_id=request.provider_id,
        adapter=request.adapter,
        target=request.target,
        operation=_OPERATIONS.get(request.operation),
        body_json=request.body_json,
        stream=request.stream,
        include_usage=request.include_usage,
        deadline_unix_ms=request.deadline_unix_ms,
        body_prepared=prepared,
        prompt_blocks=tuple(request.prompt_blocks) if prepared else None,
        traceparent=request.traceparent,
    )


def provider_config(message: pb.ProviderConfig) -> ProviderConfig:
    settings: dict[str, Any] = json.loads(message.settings_json) if message.settings_json else {}
    return ProviderConfig(
        id=message.id,
        type=message.type,
        category=_CATEGORY_FROM_PB.get(message.category, "local_inference"),
        models=tuple(message.models),
        capacity=message.capacity,
        max_queue=message.max_queue,
        queue_timeout_ms=message.queue_timeout_ms,
        request_timeout_ms=message.request_timeout_ms,
        settings=settings,
        control_state=message.control_state,
    )


def run_event(event: RunEvent, load: dict[str, Any] | None = None) -> pb.RunEvent:
    """One of a run's events as the edge reads it (``run_id`` and ``sequence`` are the
    channel's); ``load``: a run's end's provider load (``provider_load``), for an edge
    that reads it.

    The event is built from one dict (upb fills a message and its submessages from it).
    Empty fields are left out; proto3 does not send them either way. A delta's and a
    completion's usage converts alike, once below.
    """
    if isinstance(event, Started):
        start = {
            "provider_id": event.provider_id,
            "target": event.target,
            "queue_wait_ms": event.queue_wait_ms,
        }
        return pb.RunEvent(start=start)
    usage: Usage | None = None
    fields: dict[str, Any]
    if isinstance(event, Delta):
        kind, usage = "delta", event.usage
        fields = {"text": event.text, "choice_index": event.choice_index}
        if event.role:
            fields["role"] = event.role
        if event.finish_reason:
            fields["finish_reason"] = event.finish_reason
        if event.reasoning_text:
            fields["reasoning_text"] = event.reasoning_text
        if event.tool_calls:
            fields["tool_calls"] = [
                {
                    "index": call.index,
                    "id": call.id,
                    "type": call.type,
                    "function_name": call.function_name,
                    "function_arguments": call.function_arguments,
                }
                for call in event.tool_calls
            ]
        if event.logprobs_json:
            fields["logprobs_json"] = event.logprobs_json
        if event.provider_us:  # a run's first delta: its wait on the provider
            fields["provider_us"] = event.provider_us
    elif isinstance(event, Completion):
        kind, usage = "complete", event.usage
        fields = {"finish_reason": event.finish_reason, "provider_us": event.provider_us}
        if event.result_json:
            fields["result_json"] = event.result_json
        elif event.result is not None:
            fields["result_json"] = json_codec.dumps(event.result)
    else:
        kind = "error"
        fields = {
            "code": _CODES[event.code],
            "message": event.message,
            "provider_status": event.provider_status,
            "provider_us": event.provider_us,
            "context_window": event.context_window,
            "prompt_tokens": event.prompt_tokens,
        }
    if usage is not None:
        fields["usage"] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "cached_tokens": usage.cached_tokens,
        }
    if load is not None:
        fields["load"] = load
    body: dict[str, Any] = {kind: fields}
    return pb.RunEvent(**body)


def provider_load(in_flight: int, queued: int, cache: CacheView) -> dict[str, Any]:
    """A provider's load and cache account (``pb.ProviderLoad``, as a dict): what its
    snapshot carries (``provider_state``) and, for an edge that reads it, a run's end
    as the run let go of its slot (a rate of 0: unknown)."""
    return {
        "in_flight": in_flight,
        "queued": queued,
        "cache": {
            "prefixes": [{"tail": t, "blocks": b} for t, b in cache.prefixes],
            "prompt_tokens": cache.prompt_tokens,
            "cached_tokens": cache.cached_tokens,
            "prefill_ms_per_token": cache.prefill_ms_per_token or 0.0,
        },
    }


def provider_state(status: ProviderStatus) -> pb.ProviderState:
    config, flags = status.config, status.capabilities
    return pb.ProviderState(
        provider_id=config.id,
        type=config.type,
        category=_CATEGORY_TO_PB.get(config.category, pb.PROVIDER_CATEGORY_UNSPECIFIED),
        health=_HEALTH[status.health],
        capacity=config.capacity,
        max_queue=config.max_queue,
        models=list(status.models),
        capabilities=pb.LifecycleCapabilities(
            list_models=flags.list_models,
            load_model=flags.load_model,
            unload_model=flags.unload_model,
            pull_model=flags.pull_model,
            delete_model=flags.delete_model,
        ),
        last_probe_unix_ms=status.last_probe_unix_ms,
        detail=status.detail,
        engine=_engine(status),
        loaded=None if status.loaded is None else _loaded(status.loaded),
        **provider_load(status.in_flight, status.queued, status.cache),
    )


def _engine(status: ProviderStatus) -> pb.QualificationEngine | None:
    """The engine and device, once asked (``service.engine_probe``); absent before."""
    info = status.engine
    if info is None:
        return None
    return pb.QualificationEngine(
        name=info.name,
        version=info.version,
        device=info.device,
        listed_models=status.listed_models,
    )


def _loaded(state: LoadState) -> pb.LoadedModels:
    """An on-demand provider's memory (``pb.LoadedModels``)."""
    return pb.LoadedModels(
        models=[
            pb.LoadedModel(name=m.name, since_unix_ms=m.since_ms, expires_unix_ms=m.expires_ms)
            for m in state.models
        ],
        timings=[
            pb.LoadedTiming(name=t.name, last_ms=t.last_ms, mean_ms=t.mean_ms, loads=t.loads)
            for t in state.timings
        ],
        max_loaded=state.max_loaded,
    )
