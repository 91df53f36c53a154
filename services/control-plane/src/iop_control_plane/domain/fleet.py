"""The fleet configuration: which public models exist and which node providers serve them.

One file declares ``models[]`` (public id -> provider id -> served name) and ``nodes[]``
(each node's providers: type, category, capacity, queue limits and the type's own settings).
This module is pure validation; the file adapter reads YAML and the proto adapter converts
to the wire. A refused fleet raises ``FleetConfigError`` listing every problem, each naming
the entry by id (``nodes[gpu-a].providers[gpu-a-vllm].capacity``) rather than by list index,
so an operator can fix the whole file in one pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from iop_control_plane.domain import legacy
from iop_control_plane.errors import FleetConfigError

ProviderType = Literal[
    "mock", "cli", "ollama", "vllm", "sglang", "lemonade", "llamacpp", "llamaswap", "openai_api"
]
Category = Literal["api", "cli", "local_inference"]

#: Which categories each type may declare. A mock stands in for any kind of provider.
ALLOWED_CATEGORIES: Final[Mapping[str, tuple[Category, ...]]] = {
    "mock": ("api", "cli", "local_inference"),
    "cli": ("cli",),
    "ollama": ("local_inference",),
    "vllm": ("local_inference",),
    "sglang": ("local_inference",),
    "lemonade": ("local_inference",),
    "llamacpp": ("local_inference",),
    "llamaswap": ("local_inference",),
    "openai_api": ("api",),
}

Operation = Literal["chat_completions", "completions", "embeddings"]
ALL_OPERATIONS: Final[tuple[Operation, ...]] = ("chat_completions", "completions", "embeddings")
#: What each type offers when a provider lists no ``operations`` (a type not named: all). A
#: provider that lacks one of these (llama.cpp without ``--embeddings``) lists what it has.
TYPE_OPERATIONS: Final[Mapping[str, tuple[Operation, ...]]] = {
    "cli": ("chat_completions", "completions"),
}

#: The type-specific fields of `ProviderSpec` each type reads; setting any other is refused,
#: because a setting the node would silently ignore is almost always a mistake.
TYPE_SETTINGS: Final[Mapping[str, tuple[str, ...]]] = {
    "mock": ("tokens_per_second", "default_tokens"),
    "cli": ("command", "prompt_via"),
    "ollama": ("endpoint", "max_loaded_models"),  # a local daemon: it takes no key
    "vllm": ("endpoint", "api_key_env"),
    "sglang": ("endpoint", "api_key_env"),
    "lemonade": ("endpoint", "api_key_env"),
    "llamacpp": ("endpoint", "api_key_env"),
    # how many it runs at once is in its own config file (groups), which it does not publish
    "llamaswap": ("endpoint", "api_key_env", "max_loaded_models"),
    "openai_api": ("endpoint", "api_key_env"),
}
_REQUIRED_SETTINGS: Final = frozenset({"endpoint", "command"})
# in field order, so that one provider's problems are listed in the order of the class
_ALL_SETTINGS: Final = ("endpoint", "api_key_env", "command", "prompt_via", "tokens_per_second",
                        "default_tokens", "max_loaded_models")  # fmt: skip
_TOP_LEVEL_KEYS: Final = ("models", "nodes", "openai")
_UINT32_MAX: Final = 2**32 - 1  # the wire carries capacities and timeouts as uint32
_PROBLEMS: Final = "fleet_problems"  # the error type carrying id-named problems
DEFAULT_MAX_OUTPUT_TOKENS: Final = 32_768
"""A model's output cap when the file gives none (the edge's default too): a request's
``max_tokens`` above it is refused, so no client holds a slot for 2**31 tokens."""
DEFAULT_RETRIES: Final = 2
"""How often the edge runs a request again on another provider of the model when it fails
before its first byte (unreachable, 5xx, node lost); 0 turns failover off."""
MAX_RETRIES: Final = 10  # more would only hold a client through a whole failing pool


def _matching(regex: str, rule: str) -> AfterValidator:
    """A string check with an operator-readable rule instead of pydantic's raw regex."""
    pattern = re.compile(regex)

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"must be {rule}")
        return value

    return AfterValidator(check)


def _check_endpoint(value: str) -> str:
    parts = urlsplit(value)
    try:
        _ = parts.port  # raises ValueError on a malformed port
    except ValueError:
        raise ValueError("the URL's port is not a number in 0-65535") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(c.isspace() for c in value)
    ):
        raise ValueError("must be an http:// or https:// URL with a host")
    return value


def _check_command(value: list[str]) -> list[str]:
    if not value[0]:
        raise ValueError("the program (first element) must not be empty")
    return value


def _check_unique(values: list[str]) -> list[str]:
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise ValueError(f"duplicate served name(s) {duplicates}")
    return values


EntityId = Annotated[
    str,
    _matching(
        r"[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?",
        "1-63 lowercase letters, digits, '-' or '_', starting and ending with a letter or digit",
    ),
]
ModelId = Annotated[
    str,
    _matching(
        r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}",
        "1-256 letters, digits, '.', '_', ':', '/' or '-', starting with a letter or digit",
    ),
]
EnvName = Annotated[
    str, _matching(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name (letters, digits, '_')")
]
ServedName = Annotated[str, Field(min_length=1)]
Timeout = Annotated[int, Field(ge=0, le=_UINT32_MAX)]


def _raise_problems(problems: list[tuple[str, str]]) -> None:
    """Report several problems as one error; `parse_fleet` expands them, each with its path.

    A validator can raise only one error, and a plain ``ValueError`` would stop at the first
    problem and could not point below the validated object (``.category``, ``models[m]``).
    """
    if problems:
        summary = "; ".join(f"{path}: {message}" for path, message in problems)
        raise PydanticCustomError(
            _PROBLEMS, "{summary}", {"summary": summary, "problems": problems}
        )


class _Frozen(BaseModel):
    # strict: YAML already yields proper types, so "8" or true where a number belongs is a typo
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ProviderSpec(_Frozen):
    """One provider on a node: an inference backend the node dispatches runs to."""

    id: EntityId
    type: ProviderType
    category: Category
    models: Annotated[list[ServedName], Field(min_length=1), AfterValidator(_check_unique)]
    capacity: int = Field(default=1, ge=1, le=_UINT32_MAX)
    max_queue: int = Field(default=16, ge=0, le=_UINT32_MAX)
    queue_timeout_ms: Timeout = 30_000
    request_timeout_ms: Timeout = 600_000
    # what it offers; None: its type's default (`TYPE_OPERATIONS`)
    operations: Annotated[list[Operation], Field(min_length=1)] | None = None
    # type-specific settings (see TYPE_SETTINGS)
    endpoint: Annotated[str, AfterValidator(_check_endpoint)] | None = None
    api_key_env: EnvName | None = None
    command: Annotated[list[str], Field(min_length=1), AfterValidator(_check_command)] | None = None
    prompt_via: Literal["stdin", "argument"] = "stdin"
    tokens_per_second: float = Field(default=50.0, gt=0)
    default_tokens: int = Field(default=32, ge=1)
    # models the engine holds at once (Ollama's OLLAMA_MAX_LOADED_MODELS, llama-swap's
    # groups); None: unknown.
    # One model at a time makes it a host that swaps (docs/ARCHITECTURE.md#warm-aware-scheduling).
    max_loaded_models: int | None = Field(default=None, ge=1, le=_UINT32_MAX)

    @model_validator(mode="after")
    def _check_type_fit(self) -> ProviderSpec:
        problems: list[tuple[str, str]] = []
        allowed = ALLOWED_CATEGORIES[self.type]
        if self.category not in allowed:
            problems.append(
                ("category", f"{self.category!r} does not fit type {self.type!r} "
                             f"(allowed: {', '.join(allowed)})")
            )  # fmt: skip
        offered = TYPE_OPERATIONS.get(self.type, ALL_OPERATIONS)
        beyond = [o for o in self.operations or () if o not in offered]
        if beyond:
            problems.append(
                ("operations", f"type {self.type!r} does not offer {', '.join(beyond)}")
            )
        own = TYPE_SETTINGS[self.type]
        for name in _ALL_SETTINGS:
            value = getattr(self, name)
            if name in own and name in _REQUIRED_SETTINGS and value is None:
                problems.append((name, f"required for type {self.type!r}"))
            elif name not in own and name in self.model_fields_set and value is not None:
                takes = ", ".join(own)
                problems.append((name, f"not a setting of type {self.type!r} (it takes: {takes})"))
        _raise_problems(problems)
        return self

    def offered_operations(self) -> list[Operation]:
        """What it offers: its ``operations``, else its type's default, in a fixed order."""
        listed = self.operations or TYPE_OPERATIONS.get(self.type, ALL_OPERATIONS)
        return [operation for operation in ALL_OPERATIONS if operation in listed]

    def type_settings(self) -> dict[str, Any]:
        """The settings of this provider's type, defaults filled: the node adapter's input."""
        settings: dict[str, Any] = {}
        for name in TYPE_SETTINGS[self.type]:
            value = getattr(self, name)
            settings[name] = list(value) if isinstance(value, list) else value  # a copy
        return settings


class NodeSpec(_Frozen):
    """A node and the providers it runs; a node without providers is allowed (draining)."""

    id: EntityId
    providers: list[ProviderSpec] = []


class ModelSpec(_Frozen):
    """A public model: the name clients send, and which providers serve it under what name."""

    id: ModelId
    display_name: str = Field(min_length=1)
    providers: dict[EntityId, ServedName] = Field(min_length=1)
    max_output_tokens: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1, le=_UINT32_MAX)
    # failovers of a run that fails before its first byte (the edge's docs/ARCHITECTURE.md#failover)
    retries: int = Field(default=DEFAULT_RETRIES, ge=0, le=MAX_RETRIES)
    # the model's context in tokens, as its engines run it: /v1/models tells clients
    context_window: int | None = Field(default=None, ge=1, le=_UINT32_MAX)

    @model_validator(mode="after")
    def _output_fits_the_context(self) -> ModelSpec:
        # An output cap as large as the context leaves no room for a prompt: vLLM refuses
        # every request then (prompt + max_tokens past max_model_len), the default cap too.
        window = self.context_window
        if window is not None and self.max_output_tokens >= window:
            _raise_problems(
                [
                    (
                        "max_output_tokens",
                        f"must be below context_window ({window}) to leave room for the "
                        f"prompt; it is {self.max_output_tokens}"
                        + ("" if "max_output_tokens" in self.model_fields_set else " by default"),
                    )
                ]
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_display_name(cls, data: Any) -> Any:
        if (
            isinstance(data, Mapping)
            and "display_name" not in data
            and isinstance(data.get("id"), str)
        ):
            return {**data, "display_name": data["id"]}
        return data


class FleetSpec(_Frozen):
    """The whole fleet; every cross reference between models and providers is checked."""

    models: list[ModelSpec] = []
    nodes: list[NodeSpec] = []

    @model_validator(mode="after")
    def _check_references(self) -> FleetSpec:
        _raise_problems(
            reference_problems(
                [(m.id, m.providers) for m in self.models],
                [n.id for n in self.nodes],
                [(n.id, p.id, p.models) for n in self.nodes for p in n.providers],
            )
        )
        return self

    def node(self, node_id: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def provider(self, provider_id: str) -> tuple[NodeSpec, ProviderSpec] | None:
        """The provider with this id and the node it runs on."""
        for node in self.nodes:
            for provider in node.providers:
                if provider.id == provider_id:
                    return node, provider
        return None

    def models_of_provider(self, provider_id: str) -> list[ModelSpec]:
        """The public models routed to this provider, in file order."""
        return [m for m in self.models if provider_id in m.providers]


def reference_problems(
    models: Sequence[tuple[str, Mapping[str, str]]],
    node_ids: Sequence[str],
    providers: Sequence[tuple[str, str, Sequence[str] | None]],
) -> list[tuple[str, str]]:
    """Every duplicate id and dangling reference, as (entry path, message) pairs.

    Works on plain tuples so that `parse_fleet` can also run it over the raw file when some
    field is invalid (pydantic then skips `FleetSpec`'s validator), and still report all.
    ``providers`` holds (node id, provider id, served names or None when not known).
    """
    problems: list[tuple[str, str]] = []
    for kind, ids in (("model", [m[0] for m in models]), ("node", list(node_ids))):
        for dup in dict.fromkeys(i for i in ids if ids.count(i) > 1):
            problems.append((f"{kind}s", f"duplicate {kind} id {dup!r}"))
    served: dict[str, Sequence[str] | None] = {}
    home: dict[str, str] = {}
    ambiguous: set[str] = set()  # duplicated: its served names would be checked at random
    for node_id, provider_id, names in providers:
        if provider_id in home:
            ambiguous.add(provider_id)
            problems.append(
                (f"nodes[{node_id}].providers[{provider_id}]",
                 f"duplicate provider id (first defined on node {home[provider_id]!r})")
            )  # fmt: skip
            continue
        home[provider_id] = node_id
        served[provider_id] = names
    for model_id, routes in models:
        for provider_id, name in routes.items():
            where = f"models[{model_id}].providers[{provider_id}]"
            if provider_id not in served:
                known = ", ".join(served) or "none"
                problems.append((where, f"no provider has id {provider_id!r} (known: {known})"))
                continue
            names = None if provider_id in ambiguous else served[provider_id]
            if names is not None and name not in names:
                problems.append(
                    (where, f"served name {name!r} is not in that provider's models {list(names)}")
                )
    return problems


@dataclass(frozen=True)
class ParsedFleet:
    """A validated fleet and the deprecation warnings its file earned (for the log)."""

    spec: FleetSpec
    warnings: list[str]


def parse_fleet(data: Mapping[str, Any], source: str) -> ParsedFleet:
    """Validate a fleet mapping (new shape, legacy ``openai.model_routes``, or both).

    Raises `FleetConfigError` naming ``source`` and every problem found; the caller keeps
    its running fleet in that case.
    """
    problems = [
        f"{key}: unknown top-level key (allowed: {', '.join(_TOP_LEVEL_KEYS)})"
        for key in data
        if key not in _TOP_LEVEL_KEYS
    ]
    merged: dict[str, Any] = {key: data[key] for key in ("models", "nodes") if key in data}
    warnings: list[str] = []
    origins: dict[str, str] = {}
    if "openai" in data:
        converted = legacy.convert_legacy(data["openai"], _raw_ids(merged.get("models")))
        problems += converted.problems
        warnings, origins = converted.warnings, converted.origins
        merged = legacy.merge_into(merged, converted)
    try:
        spec = FleetSpec.model_validate(merged)
    except ValidationError as exc:
        problems += _describe(exc, merged, origins)
    else:
        if not problems:
            return ParsedFleet(spec=spec, warnings=warnings)
    raise FleetConfigError(source, problems)


def _raw_ids(entries: object) -> list[str]:
    if not isinstance(entries, list):
        return []
    return [e["id"] for e in entries if isinstance(e, Mapping) and isinstance(e.get("id"), str)]


def _describe(
    exc: ValidationError, data: Mapping[str, Any], origins: Mapping[str, str]
) -> list[str]:
    lines: list[str] = []
    referenced = False
    for item in exc.errors():
        base = _entry_path(item["loc"], data)
        if item["type"] == _PROBLEMS:
            referenced = referenced or not item["loc"]
            pairs = [(str(p), str(m)) for p, m in item.get("ctx", {})["problems"]]
        else:
            pairs = [("", _message(item))]
        lines += [_line(base, sub, message, origins) for sub, message in pairs]
    if not referenced:  # a field error kept FleetSpec's validator from running
        lines += [_line("", p, m, origins) for p, m in _raw_reference_problems(data)]
    return lines


def _line(base: str, sub: str, message: str, origins: Mapping[str, str]) -> str:
    if not base or not sub:
        path = base or sub
    else:
        path = base + sub if sub.startswith("[") else f"{base}.{sub}"
    prefixes = [p for p in origins if path == p or path.startswith((p + ".", p + "["))]
    origin = f" (converted from {origins[max(prefixes, key=len)]})" if prefixes else ""
    return f"{path or '(top level)'}: {message}{origin}"


def _message(item: Any) -> str:
    if item["type"] == "value_error":
        message = str(item["ctx"]["error"])
    elif item["type"] == "extra_forbidden":
        message = "unknown key"
    else:
        message = str(item["msg"])
    given = item.get("input")
    if item["type"] != "missing" and not isinstance(given, Mapping):
        message += f" (got {given!r})"
    return message


def _entry_path(loc: Sequence[int | str], data: Mapping[str, Any]) -> str:
    """Turn pydantic's ``('nodes', 0, 'providers', 1, 'capacity')`` into id-named entries."""
    path = ""
    current: Any = data
    previous: int | str | None = None
    for key in loc:
        if isinstance(key, int):
            entry = current[key] if isinstance(current, list) and 0 <= key < len(current) else None
            ident = entry.get("id") if isinstance(entry, Mapping) else None
            path += f"[{ident if isinstance(ident, str) and ident else key}]"
            current = entry
        elif key == "[key]":  # pydantic's marker for a bad dict key: the key is already named
            continue
        else:
            is_route = previous == "providers" and isinstance(current, Mapping)
            path += f"[{key}]" if is_route else f".{key}" if path else key
            current = current.get(key) if isinstance(current, Mapping) else None
        previous = key
    return path


def _raw_reference_problems(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`reference_problems` over the raw mapping, skipping entries too malformed to read."""
    models: list[tuple[str, Mapping[str, str]]] = []
    for entry in _entries(data.get("models")):
        routes = entry.get("providers")
        if isinstance(routes, Mapping):
            models.append((entry["id"], {k: v for k, v in routes.items() if isinstance(v, str)}))
    nodes = _entries(data.get("nodes"))
    providers: list[tuple[str, str, Sequence[str] | None]] = []
    for node in nodes:
        for p in _entries(node.get("providers")):
            names = p.get("models")  # not a list, or [], is refused on its own: skip its names
            providers.append(
                (node["id"], p["id"], names if isinstance(names, list) and names else None)
            )
    return reference_problems(models, [n["id"] for n in nodes], providers)


def _entries(value: object) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        return []
    return [e for e in value if isinstance(e, Mapping) and isinstance(e.get("id"), str)]
