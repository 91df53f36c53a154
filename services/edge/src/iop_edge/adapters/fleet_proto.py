"""The fleet config from the control-plane (protobuf) as the edge's domain ``Fleet``."""

from __future__ import annotations

import dataclasses
from typing import Final

from iop_edge.domain.controls import ControlEntry, preferences
from iop_edge.domain.fleet import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_RETRIES,
    NO_LIMITS,
    PUBLIC_OPERATIONS,
    ApiKeyEntry,
    BudgetPeriod,
    Fleet,
    KeyLimits,
    ModelEntry,
    Operation,
    ProviderEntry,
    offered_operations,
)
from iop_proto.v1 import runtime_pb2 as pb

_CATEGORY = {
    pb.PROVIDER_CATEGORY_API: "api",
    pb.PROVIDER_CATEGORY_CLI: "cli",
    pb.PROVIDER_CATEGORY_LOCAL_INFERENCE: "local_inference",
}

_OPERATIONS = frozenset(PUBLIC_OPERATIONS)  # a newer control-plane's unknown names are skipped


def fleet_from_proto(config: pb.FleetConfig) -> Fleet:
    providers = {
        p.id: ProviderEntry(
            id=p.id,
            node_id=node.node_id,
            type=p.type,
            category=_CATEGORY.get(p.category, "unspecified"),
            models=tuple(p.models),
            # a provider an operator disabled or drains takes no new run: no capacity
            capacity=0 if p.control_state else p.capacity,
            max_queue=p.max_queue,
            queue_timeout_ms=p.queue_timeout_ms,
            request_timeout_ms=p.request_timeout_ms,
            # none listed: a control-plane from before the field, the type's default
            operations=offered_operations(
                p.type, (Operation(o) for o in p.operations if o in _OPERATIONS)
            ),
            control_state=p.control_state,
            declared_capacity=p.declared_capacity,
            held_capacity=p.capacity if p.control_state else 0,
        )
        for node in config.nodes
        for p in node.providers
    }
    controls = tuple(
        ControlEntry(
            c.kind, c.target, c.value, c.change_id, c.changed_by, c.changed_unix_ms, c.reason
        )
        for c in config.runtime_controls
    )
    preferred = preferences(controls)
    models = {
        m.id: ModelEntry(
            id=m.id,
            display_name=m.display_name or m.id,
            # proto maps lose order; the catalog order (and the tie-break) follows the
            # node/provider order of the fleet file instead
            providers={pid: m.providers[pid] for pid in providers if pid in m.providers},
            # 0: a control-plane from before the field (or none set): the edge's default
            max_output_tokens=m.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
            # unset: a control-plane from before the field (0 is a value: no failover)
            retries=m.retries if m.HasField("retries") else DEFAULT_RETRIES,
            context_window=m.context_window,
            preference=preferred.get(m.id, ()),
        )
        for m in config.models
    }
    keys = {
        k.key_hash: ApiKeyEntry(
            key_id=k.key_id,
            name=k.name,
            key_hash=k.key_hash,
            models=frozenset(k.models),
            max_concurrent=k.max_concurrent,
            operator=k.operator,
            # unset: none, and the one NO_LIMITS, so a key without limits is told by identity
            limits=key_limits(k.limits) if k.HasField("limits") else NO_LIMITS,
            model_limits={m.model: key_limits(m.limits) for m in k.model_limits},
            weight=max(1, k.weight),
            priority=k.priority,
            expires_ms=k.expires_unix_ms,
        )
        for k in config.api_keys
    }
    previous = {
        k.previous_key_hash: dataclasses.replace(
            keys[k.key_hash], key_hash=k.previous_key_hash, expires_ms=k.previous_expires_unix_ms
        )
        for k in config.api_keys
        if k.previous_key_hash
    }
    # expired secrets: found, to be refused as expired (authenticate), with no policy at all
    for e in config.expired_keys:
        if e.key_hash not in keys:
            previous[e.key_hash] = ApiKeyEntry(
                key_id=e.key_id,
                name="",
                key_hash=e.key_hash,
                models=frozenset(),
                max_concurrent=0,
                expires_ms=max(1, e.expired_unix_ms),
            )
    return Fleet(
        version=config.version,
        models=models,
        providers=providers,
        api_keys=keys,
        previous_keys=previous,
        revoked_token_ids=frozenset(config.revoked_token_ids),
        controls=controls,
        keys_required=config.keys_required,
    )


_BUDGET_PERIODS: Final = {
    pb.BUDGET_PERIOD_DAY: BudgetPeriod.DAY,
    pb.BUDGET_PERIOD_WEEK: BudgetPeriod.WEEK,
    pb.BUDGET_PERIOD_MONTH: BudgetPeriod.MONTH,
}


def key_limits(limits: pb.KeyLimits) -> KeyLimits:
    """A key's limits as the edge holds them; an unset period is a month (the proto's word)."""
    return KeyLimits(
        requests_per_minute=limits.requests_per_minute,
        input_tokens_per_minute=limits.input_tokens_per_minute,
        output_tokens_per_minute=limits.output_tokens_per_minute,
        token_budget=limits.token_budget,
        budget_period=_BUDGET_PERIODS.get(limits.budget_period, BudgetPeriod.MONTH),
        max_concurrent=limits.max_concurrent,
    )
