"""``run_check.resolve()``: a run order from the edge becomes an ``ExecutionSpec``.

Nothing is routed here: the edge has chosen the provider and written the body's
``model`` as the provider's served name (the one rewrite of a request's model; the
node never changes it). The node checks that the run fits the provider it names and
turns the deadline into event-loop time. A body the edge prepared for its provider
(``body_prepared``) stays bytes until an adapter needs a dict; an older edge's body is
parsed here, once, so a body that is not a JSON object fails before any queue.
"""

from __future__ import annotations

from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, RunOrder, parse_body
from iop_node.errors import InvalidRequest, UnknownProvider

NO_TIMEOUT_S = 24 * 3600.0
"""The budget of a run with neither a request timeout nor an edge deadline: it still ends."""


def resolve(
    order: RunOrder,
    config: ProviderConfig | None,
    *,
    loop_now: float,
    unix_now_ms: int,
) -> ExecutionSpec:
    """Check and convert one run order; raises ``InvalidRequest`` (or ``UnknownProvider``).

    ``config`` is the node's provider of ``order.provider_id``, ``None`` if it has none.
    The deadline is the earlier of the edge's and the provider's request timeout.
    """
    run_id = order.run_id
    if not run_id:
        raise InvalidRequest("run request without a run id")
    if config is None:
        raise UnknownProvider(f"this node has no provider {order.provider_id!r}")
    adapter, target = order.adapter, order.target
    if adapter and adapter != config.type:
        raise InvalidRequest(f"provider {config.id} is of type {config.type!r}, not {adapter!r}")
    if target not in config.models:
        raise InvalidRequest(
            f"provider {config.id} does not serve {target!r} (serves {list(config.models)})"
        )
    operation = order.operation
    if operation is None:
        raise InvalidRequest("unsupported operation")
    budget_s = config.request_timeout_ms / 1000 if config.request_timeout_ms else NO_TIMEOUT_S
    if order.deadline_unix_ms > 0:
        budget_s = min(budget_s, (order.deadline_unix_ms - unix_now_ms) / 1000)
    return ExecutionSpec(
        run_id=run_id,
        model=order.model,
        provider_id=config.id,
        adapter=config.type,
        target=target,
        operation=operation,
        body_json=order.body_json,
        stream=order.stream,
        include_usage=order.include_usage,
        deadline=loop_now + max(budget_s, 0.0),
        body_prepared=order.body_prepared,
        prompt_blocks=order.prompt_blocks,
        traceparent=order.traceparent,
        parsed=None if order.body_prepared else parse_body(order.body_json),
    )
