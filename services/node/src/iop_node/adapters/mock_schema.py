"""A valid instance of a JSON Schema, the same one every time: the mock's tool arguments
and structured answers.

Client libraries' tool-calling and structured-output paths parse what the model
returns against the schema they sent; to test those paths end to end, the mock
must return something that validates. This covers the JSON Schema that OpenAI's
strict mode, Anthropic's ``input_schema`` and Pydantic emit: ``type`` (also a list
of types), ``properties``/``required``, ``items``/``prefixItems``, ``enum``,
``const``, ``anyOf``/``oneOf``/``allOf``, ``$ref`` into ``$defs``/``definitions``,
string ``format``/``minLength``/``pattern``-free bounds, numeric bounds. A keyword
it does not know is ignored; the instance may then miss it, never crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

MAX_DEPTH: Final = 16
"""Recursive schemas (a tree node holding nodes) stop here with the smallest value."""

_FORMATS: Final = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00",
    "email": "mock@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}
_TYPE_ORDER: Final = ("object", "string", "integer", "number", "boolean", "array", "null")


def instance(schema: Any) -> Any:
    """A value that validates against ``schema`` (an empty object for a missing schema)."""
    if not isinstance(schema, Mapping) or not schema:
        return {}
    return _value(schema, schema, 0)


def _value(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> Any:
    schema = _resolved(schema, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            choice = _first_non_null(options, root)
            return _value({**_without(schema, key), **choice}, root, depth)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        return _value(_merged(_without(schema, "allOf"), all_of, root), root, depth)
    kind = _type(schema)
    if kind == "object":
        return _object(schema, root, depth)
    if kind == "array":
        return _array(schema, root, depth)
    if kind == "string":
        return _string(schema)
    if kind in ("integer", "number"):
        return _number(schema, integer=kind == "integer")
    if kind == "boolean":
        return True
    return None


def _resolved(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` with a local ``$ref`` (``#/$defs/x``, ``#/definitions/x``) followed."""
    seen = 0
    while isinstance(ref := schema.get("$ref"), str) and ref.startswith("#/") and seen < MAX_DEPTH:
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
            if not isinstance(target, Mapping):
                return {}
        schema = {**_without(schema, "$ref"), **target}
        seen += 1
    return schema


def _first_non_null(options: list[Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """The first option that is not ``{"type": "null"}`` (an Optional's value, not None)."""
    mappings = [o for o in options if isinstance(o, Mapping)]
    for option in mappings:
        if _type(_resolved(option, root)) != "null":
            return option
    return mappings[0] if mappings else {}


def _merged(base: Mapping[str, Any], parts: list[Any], root: Mapping[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = dict(base)
    for part in parts:
        if not isinstance(part, Mapping):
            continue
        part = _resolved(part, root)
        for key, value in part.items():
            if key == "properties" and isinstance(value, Mapping):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _type(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [k for k in _TYPE_ORDER if k in kind and k != "null"]
        return named[0] if named else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "object"


def _object(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> dict[str, Any]:
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or depth >= MAX_DEPTH:
        return {}
    required = schema.get("required")
    # Every declared property: strict mode requires them all, and any schema accepts them.
    names = (
        list(properties)
        if not isinstance(required, list)
        else [
            *[name for name in required if name in properties],
            *[name for name in properties if name not in required],
        ]
    )
    return {
        name: _value(properties[name], root, depth + 1)
        for name in names
        if isinstance(properties[name], Mapping)
    }


def _array(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> list[Any]:
    prefix = schema.get("prefixItems")
    out: list[Any] = []
    if isinstance(prefix, list):
        out = [_value(p, root, depth + 1) for p in prefix if isinstance(p, Mapping)]
    items = schema.get("items")
    minimum = schema.get("minItems", 0)  # the fewest items: a recursive schema ends too
    count = max(int(minimum) if isinstance(minimum, int) else 0, len(out))
    if depth >= MAX_DEPTH:
        count = len(out)
    while len(out) < count:
        out.append(_value(items, root, depth + 1) if isinstance(items, Mapping) else None)
    return out


def _string(schema: Mapping[str, Any]) -> str:
    text = _FORMATS.get(str(schema.get("format", "")), "mock")
    minimum = schema.get("minLength")
    if isinstance(minimum, int) and len(text) < minimum:
        text = text + "x" * (minimum - len(text))
    maximum = schema.get("maxLength")
    if isinstance(maximum, int) and len(text) > maximum:
        text = text[:maximum]
    return text


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    value: float = 1
    if isinstance(low, int | float) and not isinstance(low, bool):
        value = low + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
    if isinstance(high, int | float) and not isinstance(high, bool) and value > high:
        value = high - (1 if "exclusiveMaximum" in schema and "maximum" not in schema else 0)
    step = schema.get("multipleOf")
    if isinstance(step, int | float) and not isinstance(step, bool) and step > 0:
        value = (value // step + (1 if value % step else 0)) * step
    return int(value) if integer else float(value)


def _without(schema: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != key}
