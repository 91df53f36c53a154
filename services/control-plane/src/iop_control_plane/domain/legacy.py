"""The deprecated fleet shape ``openai.model_routes[]``, converted to ``models[]``/``nodes[]``.

Before the provider pool, each route sent one public model to one adapter on one node:
``{model, adapter, target, node}`` plus optional provider settings. Such files still load
(docs/ARCHITECTURE.md#pool-configuration): each (node, adapter) pair becomes the
provider ``<node>-<adapter>``, each
distinct ``model`` becomes a model, and every converted route yields a deprecation warning
that says where it went, so operators can move it by hand.

This module works on raw mappings and leaves field validation to `FleetSpec`; it only
reports what the conversion itself cannot resolve (missing keys, conflicting settings for
one provider, a model defined in both shapes). It imports `fleet` for type checking only:
`fleet.parse_fleet` calls into this module, so a runtime import would be circular.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from iop_control_plane.domain.fleet import FleetSpec

#: The category a converted provider gets when its route names none. Legacy mocks stood in
#: for local engines. Must agree with `fleet.ALLOWED_CATEGORIES` (a unit test checks it).
NATURAL_CATEGORY: Final[Mapping[str, str]] = {
    "mock": "local_inference",
    "cli": "cli",
    "ollama": "local_inference",
    "vllm": "local_inference",
    "sglang": "local_inference",
    "lemonade": "local_inference",
    "llamacpp": "local_inference",
    "llamaswap": "local_inference",
    "openai_api": "api",
}
ROUTE_KEYS: Final = ("model", "adapter", "target", "node")
#: Optional per-route provider settings, copied onto the converted provider.
SETTING_KEYS: Final = (
    "category",
    "capacity",
    "max_queue",
    "queue_timeout_ms",
    "request_timeout_ms",
    "endpoint",
    "api_key_env",
    "command",
    "prompt_via",
    "tokens_per_second",
    "default_tokens",
)
_WHERE: Final = "openai.model_routes"


@dataclass(frozen=True)
class LegacyConversion:
    """New-shape entries made from the routes, plus what to tell the operator."""

    models: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: entry path (``models[m]``, ``nodes[n].providers[p]``) -> the routes it came from, so
    #: a validation error on a converted entry can point back into the file
    origins: dict[str, str] = field(default_factory=dict)


@dataclass
class _Provider:
    node: str
    type: str
    models: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    setting_route: dict[str, int] = field(default_factory=dict)  # which route set each key
    routes: list[int] = field(default_factory=list)


def convert_legacy(openai: object, defined_model_ids: Collection[str]) -> LegacyConversion:
    """Convert the ``openai`` section; ``defined_model_ids`` are the file's ``models[]`` ids."""
    result = LegacyConversion()
    if not isinstance(openai, Mapping):
        result.problems.append(f"openai: must be a mapping with model_routes (got {openai!r})")
        return result
    result.problems.extend(
        f"openai.{key}: unknown key (only model_routes is read)"
        for key in openai
        if key != "model_routes"
    )
    routes = openai.get("model_routes", [])
    if not isinstance(routes, list):
        result.problems.append(f"{_WHERE}: must be a list of routes (got {routes!r})")
        return result
    providers: dict[str, _Provider] = {}
    models: dict[str, dict[str, str]] = {}
    model_routes: dict[str, list[int]] = {}
    route_of: dict[tuple[str, str], int] = {}  # (model, provider id) -> route index
    for index, route in enumerate(routes):
        converted = _convert_route(index, route, defined_model_ids, result.problems)
        if converted is None:
            continue
        model, adapter, target, node, settings = converted
        provider_id = f"{node}-{adapter}"
        where = f"{_WHERE}[{index}]"
        earlier = route_of.get((model, provider_id))
        if earlier is not None:
            result.problems.append(
                f"{where}: model {model!r} is already routed to provider {provider_id!r} by "
                f"{_WHERE}[{earlier}]; a model has one served name per provider"
            )
            continue
        provider = providers.setdefault(provider_id, _Provider(node=node, type=adapter))
        for key, value in settings.items():
            if key in provider.settings and provider.settings[key] != value:
                first = provider.setting_route[key]
                result.problems.append(
                    f"{where}.{key}: {value!r} conflicts with {_WHERE}[{first}].{key} "
                    f"({provider.settings[key]!r}) for provider {provider_id!r}"
                )
            else:
                provider.settings[key] = value
                provider.setting_route.setdefault(key, index)
        if target not in provider.models:
            provider.models.append(target)
        provider.routes.append(index)
        route_of[(model, provider_id)] = index
        models.setdefault(model, {})[provider_id] = target
        model_routes.setdefault(model, []).append(index)
        result.warnings.append(
            f"{where} (model {model!r}, adapter {adapter!r}, node {node!r}) is deprecated: "
            f"converted to models[{model}].providers[{provider_id}] = {target!r}; "
            "move it to models[]/nodes[]"
        )
    for model, routed in models.items():
        result.models.append({"id": model, "providers": dict(routed)})
        result.origins[f"models[{model}]"] = _route_list(model_routes[model])
    nodes: dict[str, list[dict[str, Any]]] = {}
    for provider_id, provider in providers.items():
        settings = dict(provider.settings)
        category = settings.pop("category", NATURAL_CATEGORY[provider.type])
        entry = {"id": provider_id, "type": provider.type, "category": category}
        nodes.setdefault(provider.node, []).append({**entry, "models": provider.models, **settings})
        result.origins[f"nodes[{provider.node}].providers[{provider_id}]"] = _route_list(
            provider.routes
        )
    result.nodes.extend({"id": node, "providers": entries} for node, entries in nodes.items())
    return result


def merge_into(new_shape: dict[str, Any], converted: LegacyConversion) -> dict[str, Any]:
    """The file's own ``models``/``nodes`` plus the converted entries, as one mapping.

    A converted provider whose node is already declared in ``nodes[]`` joins that node.
    """
    models, nodes = new_shape.get("models", []), new_shape.get("nodes", [])
    if not isinstance(models, list) or not isinstance(nodes, list):
        return new_shape  # refused for its shape anyway
    out_nodes = list(nodes)
    for node in converted.nodes:
        for i, existing in enumerate(out_nodes):
            if isinstance(existing, Mapping) and existing.get("id") == node["id"]:
                providers = existing.get("providers", [])
                if isinstance(providers, list):
                    out_nodes[i] = {**existing, "providers": [*providers, *node["providers"]]}
                break
        else:
            out_nodes.append(node)
    return {**new_shape, "models": [*models, *converted.models], "nodes": out_nodes}


def _convert_route(
    index: int, route: object, defined_model_ids: Collection[str], problems: list[str]
) -> tuple[str, str, str, str, dict[str, Any]] | None:
    """One route's (model, adapter, target, node, settings), or None after noting why not."""
    where = f"{_WHERE}[{index}]"
    if not isinstance(route, Mapping):
        problems.append(f"{where}: must be a mapping with {', '.join(ROUTE_KEYS)} (got {route!r})")
        return None
    allowed = (*ROUTE_KEYS, *SETTING_KEYS)
    unknown = [f"{where}.{key}: unknown key" for key in route if key not in allowed]
    missing = [
        f"{where}.{key}: "
        + (f"must be a non-empty string (got {route[key]!r})" if key in route else "required")
        for key in ROUTE_KEYS
        if not isinstance(route.get(key), str) or not route[key]
    ]
    problems += unknown + missing
    if unknown or missing:
        return None
    model, adapter, target, node = (str(route[key]) for key in ROUTE_KEYS)
    if adapter not in NATURAL_CATEGORY:
        known = ", ".join(NATURAL_CATEGORY)
        problems.append(f"{where}.adapter: unknown provider type {adapter!r} (known: {known})")
        return None
    if model in defined_model_ids:
        problems.append(
            f"{where}: model {model!r} is already defined in models[]; define it in one place"
        )
        return None
    settings = {key: route[key] for key in SETTING_KEYS if key in route}
    return model, adapter, target, node, settings


def _route_list(indexes: list[int]) -> str:
    return ", ".join(f"{_WHERE}[{i}]" for i in indexes)


def to_legacy_routes(spec: FleetSpec) -> list[dict[str, Any]]:
    """Export a fleet as legacy routes, grouped by model in file order.

    Each route carries its provider's explicitly set settings (and its category when not
    the natural one), so legacy routes -> `parse_fleet` -> this gives the same routes back
    when each model's routes were contiguous. Lossy for what routes cannot express: display
    names, provider ids other than ``<node>-<type>``, served names no model routes to.
    """
    routes: list[dict[str, Any]] = []
    for model in spec.models:
        for provider_id, target in model.providers.items():
            found = spec.provider(provider_id)
            if found is None:  # impossible in a validated fleet
                continue
            node, provider = found
            route: dict[str, Any] = {
                "model": model.id,
                "adapter": provider.type,
                "target": target,
                "node": node.id,
            }
            if provider.category != NATURAL_CATEGORY[provider.type]:
                route["category"] = provider.category
            for key in SETTING_KEYS[1:]:
                value = getattr(provider, key)
                if key in provider.model_fields_set and value is not None:
                    route[key] = list(value) if isinstance(value, list) else value
            routes.append(route)
    return routes
