"""Conversions between the node's domain types and the protobuf contract (the one place).

In: provider configs and run orders (``run_order``). Out: provider states and run
events (``delta_event``, ``complete_event``, ``start_event``, ``failed_event``, a run's
end with its provider's load: ``provider_load``), with the error codes' wire numbers.
Nothing else in the node imports ``iop_proto.v1``.
"""

from __future__ import annotations

import json
from typing import Any

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.cache_account import CacheView
from iop_node.domain.events import Failed, Started
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


def usage(value: Usage) -> dict[str, int]:
    """A ``pb.Usage`` as the dict the protobuf constructors take for it."""
    return {
        "prompt_tokens": value.prompt_tokens,
        "completion_tokens": value.completion_tokens,
        "total_tokens": value.total_tokens,
        "cached_tokens": value.cached_tokens,
    }


# The run events are built from dicts (upb fills a message and its submessages from one).
# Empty fields are left out; proto3 does not send them either way.


def delta_event(delta: Delta, provider_us: int = 0) -> pb.RunEvent:
    """A ``run.event`` carrying one delta (``run_id`` and ``sequence`` are the channel's);
    ``provider_us``: the run's first delta's wait on the provider, which the channel saw."""
    fields: dict[str, Any] = {"text": delta.text, "choice_index": delta.choice_index}
    if delta.role:
        fields["role"] = delta.role
    if delta.finish_reason:
        fields["finish_reason"] = delta.finish_reason
    if delta.reasoning_text:
        fields["reasoning_text"] = delta.reasoning_text
    if delta.tool_calls:
        fields["tool_calls"] = [
            {
                "index": call.index,
                "id": call.id,
                "type": call.type,
                "function_name": call.function_name,
                "function_arguments": call.function_arguments,
            }
            for call in delta.tool_calls
        ]
    if delta.usage is not None:
        fields["usage"] = usage(delta.usage)
    if delta.logprobs_json:
        fields["logprobs_json"] = delta.logprobs_json
    if provider_us or delta.provider_us:
        fields["provider_us"] = provider_us or delta.provider_us
    return pb.RunEvent(delta=fields)


def complete_event(completion: Completion, load: dict[str, Any] | None = None) -> pb.RunEvent:
    """The ``run.event`` that ends a run well, with the provider's result when it gave one
    (``load``: its provider's, ``provider_load``, for an edge that reads it)."""
    fields: dict[str, Any] = {
        "finish_reason": completion.finish_reason,
        "provider_us": completion.provider_us,
    }
    if completion.usage is not None:
        fields["usage"] = usage(completion.usage)
    if completion.result_json:
        fields["result_json"] = completion.result_json
    elif completion.result is not None:
        fields["result_json"] = json_codec.dumps(completion.result)
    if load is not None:
        fields["load"] = load
    return pb.RunEvent(complete=fields)


def start_event(start: Started) -> pb.RunEvent:
    return pb.RunEvent(
        start={
            "provider_id": start.provider_id,
            "target": start.target,
            "queue_wait_ms": start.queue_wait_ms,
        }
    )


def failed_event(failure: Failed, load: dict[str, Any] | None = None) -> pb.RunEvent:
    fields: dict[str, Any] = {
        "code": _CODES[failure.code],
        "message": failure.message,
        "provider_status": failure.provider_status,
        "provider_us": failure.provider_us,
        "context_window": failure.context_window,
        "prompt_tokens": failure.prompt_tokens,
    }
    if load is not None:
        fields["load"] = load
    return pb.RunEvent(error=fields)


def provider_load(gate: AdmissionGate, cache: CacheView) -> dict[str, Any]:
    """A run's provider as the run ends (``pb.ProviderLoad``, as the event's dict): the
    load and the cache account its snapshot would carry, for an edge that reads them."""
    return {"in_flight": gate.in_flight, "queued": gate.queued, "cache": _cache_state(cache)}


def _cache_state(cache: CacheView) -> dict[str, Any]:
    """The cache account (``pb.CacheState``; a rate of 0: unknown)."""
    return {
        "prefixes": [{"tail": t, "blocks": b} for t, b in cache.prefixes],
        "prompt_tokens": cache.prompt_tokens,
        "cached_tokens": cache.cached_tokens,
        "prefill_ms_per_token": cache.prefill_ms_per_token or 0.0,
    }


def provider_state(status: ProviderStatus) -> pb.ProviderState:
    config, flags = status.config, status.capabilities
    return pb.ProviderState(
        provider_id=config.id,
        type=config.type,
        category=_CATEGORY_TO_PB.get(config.category, pb.PROVIDER_CATEGORY_UNSPECIFIED),
        health=_HEALTH[status.health],
        capacity=config.capacity,
        in_flight=status.in_flight,
        queued=status.queued,
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
        cache=_cache_state(status.cache),
        engine=_engine(status),
        loaded=None if status.loaded is None else _loaded(status.loaded),
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
