"""The fleet on the wire and in the admin API: `FleetSpec` -> protobuf and a JSON view.

The domain stays free of protobuf (see STYLE.md); this is the one place that knows the
``NodeConfig``/``ModelConfig`` messages and the category enum.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Set
from datetime import datetime
from typing import Any, Final

from iop_control_plane.domain.credentials import ApiKey, accepts, secret_expiry
from iop_control_plane.domain.fleet import Category, FleetSpec, NodeSpec, ProviderSpec
from iop_control_plane.domain.key_limits import BudgetPeriod, KeyLimits
from iop_proto.v1 import runtime_pb2 as pb

CATEGORY_TO_PROTO: Final[dict[Category, pb.ProviderCategory]] = {
    "api": pb.PROVIDER_CATEGORY_API,
    "cli": pb.PROVIDER_CATEGORY_CLI,
    "local_inference": pb.PROVIDER_CATEGORY_LOCAL_INFERENCE,
}


BUDGET_PERIOD_TO_PROTO: Final[dict[BudgetPeriod, pb.BudgetPeriod]] = {
    BudgetPeriod.DAY: pb.BUDGET_PERIOD_DAY,
    BudgetPeriod.WEEK: pb.BUDGET_PERIOD_WEEK,
    BudgetPeriod.MONTH: pb.BUDGET_PERIOD_MONTH,
}


def limits_to_proto(limits: KeyLimits) -> pb.KeyLimits:
    """A key's (or a key's per-model) limits as the edges get them."""
    return pb.KeyLimits(
        requests_per_minute=limits.requests_per_minute,
        input_tokens_per_minute=limits.input_tokens_per_minute,
        output_tokens_per_minute=limits.output_tokens_per_minute,
        token_budget=limits.token_budget,
        budget_period=BUDGET_PERIOD_TO_PROTO[limits.budget_period],
        max_concurrent=limits.max_concurrent,
    )


def key_expiry_to_proto(key: ApiKey, now: datetime) -> tuple[int, str, int]:
    """``expires_unix_ms``, ``previous_key_hash`` and ``previous_expires_unix_ms`` of a key's
    policy at ``now``: a rotation's previous secret only while its overlap lasts (its end
    capped by the key's own expiry, as ``secret_expiry`` says)."""
    expires_ms = _unix_ms(key.expires_at)
    rotation = key.rotation
    if rotation is None or not accepts(key, rotation.previous_hash, now):
        return expires_ms, "", 0
    return expires_ms, rotation.previous_hash, _unix_ms(secret_expiry(key, rotation.previous_hash))


EXPIRED_LISTED_S: Final = 7 * 86400
"""How long after its expiry a secret is still sent to the edges as expired (to be refused
saying so): long enough for clients to be told why, short enough to keep the list small."""


def expired_keys_to_proto(keys: Iterable[ApiKey], now: datetime) -> list[pb.ExpiredKey]:
    """The secrets of ``keys`` (not revoked ones: those are refused as unknown, as before)
    whose expiry, or rotation overlap, passed within ``EXPIRED_LISTED_S`` of ``now``."""
    expired = []
    for key in keys:
        if key.revoked:
            continue
        hashes = [key.secret_hash]
        if key.rotation is not None:
            hashes.append(key.rotation.previous_hash)
        for secret_hash in hashes:
            ended = secret_expiry(key, secret_hash)
            if ended is not None and 0 <= (now - ended).total_seconds() < EXPIRED_LISTED_S:
                expired.append(
                    pb.ExpiredKey(
                        key_id=key.key_id, key_hash=secret_hash, expired_unix_ms=_unix_ms(ended)
                    )
                )
    return expired


def _unix_ms(moment: datetime | None) -> int:
    return 0 if moment is None else math.ceil(moment.timestamp() * 1000)


def settings_json(provider: ProviderSpec) -> bytes:
    """The type's settings as compact JSON with sorted keys: identical specs, identical bytes."""
    return json.dumps(provider.type_settings(), separators=(",", ":"), sort_keys=True).encode()


def provider_config_to_proto(provider: ProviderSpec) -> pb.ProviderConfig:
    return pb.ProviderConfig(
        id=provider.id,
        type=provider.type,
        category=CATEGORY_TO_PROTO[provider.category],
        models=provider.models,
        capacity=provider.capacity,
        max_queue=provider.max_queue,
        queue_timeout_ms=provider.queue_timeout_ms,
        request_timeout_ms=provider.request_timeout_ms,
        settings_json=settings_json(provider),
        operations=provider.offered_operations(),
    )


def node_config_to_proto(node: NodeSpec) -> pb.NodeConfig:
    """What a node receives when it is authorized: its own providers, nothing else."""
    return pb.NodeConfig(
        node_id=node.id, providers=[provider_config_to_proto(p) for p in node.providers]
    )


def models_to_proto(spec: FleetSpec, without: Set[str] = frozenset()) -> list[pb.ModelConfig]:
    """The model catalog for the edge: public id, display name, provider id -> served name,
    output cap, failovers, context window; ``without``: providers left out (those of
    retired nodes)."""
    return [
        pb.ModelConfig(
            id=m.id,
            display_name=m.display_name,
            providers={p: served for p, served in m.providers.items() if p not in without},
            max_output_tokens=m.max_output_tokens,
            retries=m.retries,
            context_window=m.context_window or 0,
        )
        for m in spec.models
    ]


def fleet_view(spec: FleetSpec) -> dict[str, Any]:
    """A read-only, JSON-ready view of the fleet for operators (the admin API).

    Holds no secrets: upstream keys live in environment variables and only the variable's
    name (``api_key_env``) appears here.
    """
    models = []
    for model in spec.models:
        routes = []
        for provider_id, served in model.providers.items():
            found = spec.provider(provider_id)
            node_id, provider = (found[0].id, found[1]) if found else (None, None)
            routes.append(
                {
                    "provider_id": provider_id,
                    "node_id": node_id,
                    "served_name": served,
                    "type": provider.type if provider else None,
                    "category": provider.category if provider else None,
                }
            )
        models.append(
            {
                "id": model.id,
                "display_name": model.display_name,
                "max_output_tokens": model.max_output_tokens,
                "context_window": model.context_window,
                "retries": model.retries,
                "providers": routes,
            }
        )
    nodes = [
        {
            "id": node.id,
            "providers": [
                {
                    "id": p.id,
                    "type": p.type,
                    "category": p.category,
                    "models": list(p.models),
                    "capacity": p.capacity,
                    "max_queue": p.max_queue,
                    "queue_timeout_ms": p.queue_timeout_ms,
                    "request_timeout_ms": p.request_timeout_ms,
                    "operations": p.offered_operations(),
                    "settings": p.type_settings(),
                }
                for p in node.providers
            ],
        }
        for node in spec.nodes
    ]
    return {"models": models, "nodes": nodes}
