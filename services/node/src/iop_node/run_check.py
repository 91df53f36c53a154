"""``run_check.resolve()``: a run request from the edge becomes an ``ExecutionSpec``.

Nothing is routed here: the edge has chosen the provider and written the body's
``model`` as the provider's served name (the one rewrite of a request's model).
The node checks that the run fits the provider it names, parses the body once and
turns the deadline into event-loop time; adapters send the body as it is.
"""

from __future__ import annotations

import math
from typing import Any

from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.errors import InvalidRequest, UnknownProvider
from iop_proto import json_codec
from iop_proto.v1 import runtime_pb2 as pb

_OPERATIONS = {
    pb.OPERATION_CHAT_COMPLETIONS: Operation.CHAT_COMPLETIONS,
    pb.OPERATION_COMPLETIONS: Operation.COMPLETIONS,
    pb.OPERATION_EMBEDDINGS: Operation.EMBEDDINGS,
    pb.OPERATION_COUNT_TOKENS: Operation.COUNT_TOKENS,
}


def resolve(
    request: pb.RunRequest,
    config: ProviderConfig | None,
    *,
    loop_now: float,
    unix_now_ms: int,
) -> ExecutionSpec:
    """Check and convert one run request; raises ``InvalidRequest`` (or ``UnknownProvider``).

    ``config`` is the node's provider of ``request.provider_id``, ``None`` if it has none.
    """
    run_id = request.run_id
    if not run_id:
        raise InvalidRequest("run request without a run id")
    if config is None:
        raise UnknownProvider(f"this node has no provider {request.provider_id!r}")
    adapter, target = request.adapter, request.target
    if adapter and adapter != config.type:
        raise InvalidRequest(f"provider {config.id} is of type {config.type!r}, not {adapter!r}")
    if target not in config.models:
        raise InvalidRequest(
            f"provider {config.id} does not serve {target!r} (serves {list(config.models)})"
        )
    operation = _OPERATIONS.get(request.operation)
    if operation is None:
        raise InvalidRequest(f"unsupported operation {request.operation}")
    body = _parse_body(request.body_json)
    if body.get("model") != target:  # never from this edge, which sends it as the target
        body["model"] = target
    return ExecutionSpec(
        run_id=run_id,
        model=request.model,
        provider_id=config.id,
        adapter=config.type,
        target=target,
        operation=operation,
        body=body,
        stream=request.stream,
        include_usage=request.include_usage,
        deadline=_deadline(request.deadline_unix_ms, config, loop_now, unix_now_ms),
    )


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json_codec.loads(raw) if raw else {}
    except ValueError as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _deadline(
    deadline_unix_ms: int, config: ProviderConfig, loop_now: float, unix_now_ms: int
) -> float:
    """The earlier of the edge's deadline and the provider's request timeout, on the loop clock."""
    budget_s = config.request_timeout_ms / 1000 if config.request_timeout_ms else math.inf
    if deadline_unix_ms > 0:
        budget_s = min(budget_s, (deadline_unix_ms - unix_now_ms) / 1000)
    if budget_s == math.inf:
        budget_s = 24 * 3600.0  # "no timeout" still ends some day
    return loop_now + max(budget_s, 0.0)
