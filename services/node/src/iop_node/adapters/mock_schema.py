"""A valid instance of a JSON Schema, the same one every time: the mock's tool arguments
and structured answers.

Client libraries' and coding agents' tool-calling paths validate what the model returns
against the schema they sent, and an agent then runs the call; to test those paths end
to end, the mock must return something that validates, and that is harmless to run.
This covers the JSON Schema that OpenAI's strict mode, Anthropic's ``input_schema``,
Pydantic and zod (opencode) emit, drafts 4 to 2020-12:

- ``type`` (also a list), ``integer`` apart from ``number``; ``const``, ``enum``;
- numbers: ``minimum``/``maximum``, ``exclusiveMinimum``/``exclusiveMaximum`` (numbers,
  or draft 4's booleans), ``multipleOf``;
- strings: ``minLength``/``maxLength``, ``format`` (``date-time``, ``date``, ``time``,
  ``duration``, ``email``, ``uri``/``url``/``iri``/``uri-reference``, ``uuid``,
  ``ipv4``/``ipv6``, ``hostname``, ``regex``, ...), ``pattern`` (a string made from the
  regular expression itself when the usual values do not match it);
- objects: ``properties``/``required`` (the required ones only, plus optional ones while
  ``minProperties`` wants more, so no optional flag is switched on by the mock),
  ``additionalProperties``, ``dependentRequired``;
- arrays: ``items``/``prefixItems`` (draft 4's list ``items`` too), ``minItems``,
  ``maxItems``, ``contains``, ``uniqueItems`` (distinct items);
- ``anyOf``/``oneOf`` (the first option that is not ``null``), ``allOf`` (merged, the
  tightest bounds winning), ``$ref`` into ``$defs``/``definitions`` or ``#``.

Values an agent runs: a property's name picks the value where the schema allows it
(:data:`HINTS`): a ``command``/``cmd`` gets ``echo iop-mock`` (as an argv list
``["echo", "iop-mock"]`` where it is an array), a path-like name (``path``,
``file_path``, ``filePath``, ``workdir``, ``cwd``, ``dir`` ...) gets ``.``, a
``pattern``/``glob``/``regex``/``query`` gets ``iop-mock`` (a valid glob and regex that
matches next to nothing), a ``timeout`` number 10000; booleans are ``false`` (no flag
such as ``run_in_background`` switched on). A keyword it does not know (``not``,
``if``) is ignored: the instance may then miss it, never crash.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any, Final, TypeGuard

MAX_DEPTH: Final = 16
"""Recursive schemas (a tree node holding nodes) stop here with the smallest value."""

FORMATS: Final = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "duration": "P1D",
    "email": "mock@example.com",
    "idn-email": "mock@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "iri-reference": "https://example.com/",
    "uri-template": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "json-pointer": "/mock",
    "relative-json-pointer": "0",
    "regex": "iop-mock",
    "byte": "bW9jaw==",
    "int32": "1",
    "int64": "1",
}

COMMAND: Final = "echo iop-mock"
HINTS: Final = {
    "command": COMMAND,
    "cmd": COMMAND,
    "path": ".",
    "filepath": ".",
    "file": ".",
    "filename": ".",
    "notebookpath": ".",
    "dir": ".",
    "directory": ".",
    "folder": ".",
    "workdir": ".",
    "workingdirectory": ".",
    "cwd": ".",
    "pattern": "iop-mock",
    "glob": "iop-mock",
    "regex": "iop-mock",
    "query": "iop-mock",
    "timeout": 10000,
    "timeoutms": 10000,
}
"""Values by property name (lower case, without ``_``/``-``): used when the schema allows."""

_TYPE_ORDER: Final = ("object", "string", "integer", "number", "boolean", "array", "null")
_LOWER: Final = ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum")
_UPPER: Final = ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum")
_STRETCH: Final = (0, 1, 2, 3, 5, 8, 13, 21, 34, 64)


def instance(schema: Any) -> Any:
    """A value that validates against ``schema`` (an empty object for a missing schema)."""
    if not isinstance(schema, Mapping) or not schema:
        return {}
    return _Maker(schema).value(schema, 0)


def hint(name: str | None) -> Any:
    """The value :data:`HINTS` gives a property called ``name``, or ``None``."""
    if not name:
        return None
    return HINTS.get(name.lower().replace("_", "").replace("-", ""))


class _Maker:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self._root = root

    def value(self, schema: Any, depth: int, name: str | None = None, variant: int = 0) -> Any:
        if schema is True or schema == {}:
            found = hint(name)
            return found if found is not None else "mock"
        if not isinstance(schema, Mapping):
            return None  # ``false`` (nothing validates) or not a schema
        schema = self._flat(schema)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[variant % len(enum)]
        kind = _type(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth, name, variant)
        if kind == "string":
            return _string(schema, hint(name), variant)
        if kind in ("integer", "number"):
            return _number(schema, hint(name), variant, integer=kind == "integer")
        if kind == "boolean":
            return variant % 2 == 1
        return None

    def _flat(self, given: Any) -> Mapping[str, Any]:
        """``given`` with ``$ref``, ``anyOf``/``oneOf`` and ``allOf`` resolved into one."""
        if not isinstance(given, Mapping):
            return {}
        schema: Mapping[str, Any] = given
        for _ in range(MAX_DEPTH):
            schema = self._resolved(schema)
            for key in ("anyOf", "oneOf"):
                options = schema.get(key)
                if isinstance(options, list) and options:
                    schema = _merge(_without(schema, key), self._first_non_null(options))
                    break
            else:
                parts = schema.get("allOf")
                if not (isinstance(parts, list) and parts):
                    return schema
                schema = _without(schema, "allOf")
                for part in parts:
                    if isinstance(part, Mapping):
                        schema = _merge(schema, self._resolved(part))
        return schema

    def _resolved(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        """``schema`` with a local ``$ref`` (``#``, ``#/$defs/x``, ...) followed."""
        for _ in range(MAX_DEPTH):
            ref = schema.get("$ref")
            if not (isinstance(ref, str) and ref.startswith("#")):
                break
            target: Any = self._root
            for part in filter(None, ref[1:].split("/")):
                target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
                if not isinstance(target, Mapping):
                    return {}
            schema = _merge(_without(schema, "$ref"), target)
        return schema

    def _first_non_null(self, options: list[Any]) -> Mapping[str, Any]:
        """The first option that is not ``{"type": "null"}`` (an Optional's value)."""
        mappings = [o for o in options if isinstance(o, Mapping)]
        for option in mappings:
            if _type(self._flat(option)) != "null":
                return option
        return mappings[0] if mappings else {}

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = [n for n in schema.get("required", ()) if isinstance(n, str)]
        if depth >= MAX_DEPTH:
            required = []
        names = list(dict.fromkeys(required))
        fewest = schema.get("minProperties", 0)
        optional = iter([n for n in properties if n not in names])
        while isinstance(fewest, int) and len(names) < fewest:
            names.append(next(optional, f"mock{len(names)}"))
        dependent = schema.get("dependentRequired")
        if isinstance(dependent, Mapping):
            for name in list(names):
                names.extend(n for n in dependent.get(name, ()) if n not in names)
        out: dict[str, Any] = {}
        for name in names:
            out[name] = self.value(self._property(schema, properties, name), depth + 1, name)
        return out

    @staticmethod
    def _property(schema: Mapping[str, Any], properties: Mapping[str, Any], name: str) -> Any:
        if name in properties:
            return properties[name]
        patterns = schema.get("patternProperties")
        for pattern, sub in patterns.items() if isinstance(patterns, Mapping) else ():
            if _search(pattern, name):
                return sub
        extra = schema.get("additionalProperties", True)
        return extra if isinstance(extra, Mapping) else True

    def _array(
        self, schema: Mapping[str, Any], depth: int, name: str | None, variant: int
    ) -> list[Any]:
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # draft 4: a tuple
            prefix, items = items, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        fewest = schema.get("minItems", 0)
        fewest = fewest if isinstance(fewest, int) else 0
        most = schema.get("maxItems")
        contains = schema.get("contains")
        room = fewest <= 2 and (not isinstance(most, int) or most >= 2)
        if hint(name) == COMMAND and not prefix and room and _accepts_words(self._flat(items)):
            return COMMAND.split()  # an argv list
        count = max(fewest, len(prefix), 1 if contains is not None else 0)
        if depth >= MAX_DEPTH:
            count = len(prefix)
        out = [self.value(p, depth + 1, None, variant) for p in prefix[:count]]
        if contains is not None and len(out) < count:
            out.append(self.value(contains, depth + 1, None, variant))
        while len(out) < count:
            # distinct items (uniqueItems): each one the next variant of the item schema
            out.append(self.value(items, depth + 1, None, variant + len(out)))
        return out


def _accepts_words(items: Mapping[str, Any]) -> bool:
    """Whether every word of :data:`COMMAND` is a valid item."""
    if _type(items) != "string" or {"enum", "const", "pattern", "format"} & set(items):
        return False
    words = COMMAND.split()
    fewest, most = items.get("minLength", 0), items.get("maxLength")
    return all(len(w) >= fewest and (most is None or len(w) <= most) for w in words)


def _merge(base: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """Both schemas at once (``allOf``, or an option with its siblings): properties and
    required names joined, the tightest bound of each kind kept."""
    merged: dict[str, Any] = dict(base)
    for key, value in part.items():
        if key not in merged:
            merged[key] = value
        elif key == "properties" and isinstance(value, Mapping):
            mine = merged[key] if isinstance(merged[key], Mapping) else {}
            merged[key] = {
                **mine,
                **{k: ({"allOf": [mine[k], v]} if k in mine else v) for k, v in value.items()},
            }
        elif key == "required" and isinstance(value, list):
            merged[key] = list(dict.fromkeys([*merged[key], *value]))
        elif key in _LOWER and _is_number(value) and _is_number(merged[key]):
            merged[key] = max(merged[key], value)
        elif key in _UPPER and _is_number(value) and _is_number(merged[key]):
            merged[key] = min(merged[key], value)
        elif key == "type" and isinstance(value, str | list):
            mine = merged[key] if isinstance(merged[key], list) else [merged[key]]
            theirs = value if isinstance(value, list) else [value]
            both = [t for t in theirs if t in mine or (t == "integer" and "number" in mine)]
            merged[key] = both or theirs
    return merged


def _type(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [k for k in _TYPE_ORDER if k in kind and k != "null"]
        return named[0] if named else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "object"


# -- strings ---------------------------------------------------------------------------


def _string(schema: Mapping[str, Any], hinted: Any, variant: int) -> str:
    fewest = schema.get("minLength", 0)
    fewest = fewest if isinstance(fewest, int) else 0
    most = schema.get("maxLength")
    most = most if isinstance(most, int) else None
    pattern = schema.get("pattern")
    formatted = FORMATS.get(str(schema.get("format", "")))

    def fits(text: str) -> bool:
        if len(text) < fewest or (most is not None and len(text) > most):
            return False
        return not isinstance(pattern, str) or _search(pattern, text)

    if formatted is not None:
        candidates = [formatted]  # a formatted value stays whole: padding would break it
    else:
        seeds = [s for s in (hinted, "mock") if isinstance(s, str)]
        seeds = [f"{s}{variant}" if variant else s for s in seeds]
        candidates = [text + "x" * max(0, fewest - len(text)) for text in seeds]
        if most is not None:
            candidates += [text[:most] for text in candidates]
        candidates.append(_letters(variant) + "x" * max(0, fewest - 1))
    if isinstance(pattern, str):
        candidates.extend(_from_regex(pattern, variant))
    for text in candidates:
        if fits(text):
            return text
    return candidates[0]


def _letters(variant: int) -> str:
    """``a``, ``b``, ... ``z``, ``ba``, ...: the ``variant``-th short distinct string."""
    text = ""
    while True:
        variant, digit = divmod(variant, 26)
        text = chr(ord("a") + digit) + text
        if not variant:
            return text


def _search(pattern: str, text: str) -> bool:
    """JSON Schema's ``pattern``: an unanchored search; an unreadable pattern never fits."""
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def _from_regex(pattern: str, variant: int) -> Iterator[str]:
    """Strings made from ``pattern``'s parse tree (Python's own regular expression
    parser), each repetition ``stretch`` times past its fewest; variants vary the
    character classes' picks."""
    try:
        parser: Any = importlib.import_module("re._parser")
        tree = parser.parse(pattern)
    except (ImportError, re.error, RecursionError):
        return
    for stretch in _STRETCH:
        try:
            yield _render(tree, stretch, variant, {})
        except (ValueError, IndexError, TypeError, KeyError, RecursionError):
            return


def _render(tree: Iterable[Any], stretch: int, variant: int, groups: dict[int, str]) -> str:
    out: list[str] = []
    for op, arg in tree:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name in ("ANY", "NOT_LITERAL"):
            out.append("a" if name == "ANY" or chr(arg) != "a" else "b")
        elif name == "IN":
            out.append(_pick(arg, variant))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            times = low + stretch if str(high) == "MAXREPEAT" else min(high, low + stretch)
            out.extend(_render(sub, stretch, variant, groups) for _ in range(times))
        elif name == "SUBPATTERN":
            group, sub = arg[0], arg[-1]
            text = _render(sub, stretch, variant, groups)
            if group is not None:
                groups[group] = text
            out.append(text)
        elif name == "ATOMIC_GROUP":
            out.append(_render(arg, stretch, variant, groups))
        elif name == "BRANCH":
            branches = arg[1]
            out.append(_render(branches[variant % len(branches)], stretch, variant, groups))
        elif name == "GROUPREF":
            out.append(groups.get(arg, ""))
        elif name == "CATEGORY":
            out.append(_category(str(arg)))
        # AT (anchors), ASSERT and ASSERT_NOT add no characters
    return "".join(out)


def _pick(items: list[Any], variant: int) -> str:
    """A character of a ``[...]`` class: the ``variant``-th it allows."""
    if items and str(items[0][0]) == "NEGATE":
        banned = {chr(arg) for op, arg in items[1:] if str(op) == "LITERAL"}
        for op, arg in items[1:]:
            if str(op) == "RANGE":
                banned.update(chr(c) for c in range(arg[0], min(arg[1], 0x7F) + 1))
        allowed = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789" if c not in banned]
        return allowed[variant % len(allowed)] if allowed else "~"
    choices: list[str] = []
    for op, arg in items:
        kind = str(op)
        if kind == "LITERAL":
            choices.append(chr(arg))
        elif kind == "RANGE":
            choices.extend(chr(c) for c in range(arg[0], min(arg[1], arg[0] + 25) + 1))
        elif kind == "CATEGORY":
            choices.append(_category(str(arg)))
    return choices[variant % len(choices)]


def _category(name: str) -> str:
    return {
        "CATEGORY_DIGIT": "0",
        "CATEGORY_NOT_DIGIT": "a",
        "CATEGORY_SPACE": " ",
        "CATEGORY_NOT_SPACE": "a",
        "CATEGORY_WORD": "a",
        "CATEGORY_NOT_WORD": "-",
    }.get(name, "a")


# -- numbers ---------------------------------------------------------------------------


def _number(schema: Mapping[str, Any], hinted: Any, variant: int, *, integer: bool) -> Any:
    """The ``variant``-th number the bounds, ``multipleOf`` and integrality allow,
    trying the hint, 1 and 0 first."""
    low, low_open = _bound(schema, "minimum", "exclusiveMinimum", max)
    high, high_open = _bound(schema, "maximum", "exclusiveMaximum", min)
    step = schema.get("multipleOf")
    step = step if _is_number(step) and step > 0 else None

    def fits(value: float) -> bool:
        if integer and value != int(value):
            return False
        if low is not None and (value < low or (low_open and value == low)):
            return False
        if high is not None and (value > high or (high_open and value == high)):
            return False
        return step is None or _multiple(value, step)

    found: list[Any] = []
    for value in _number_candidates(low, high, step, hinted, integer=integer):
        if math.isfinite(value) and fits(value) and value not in found:
            found.append(value)
            if len(found) > variant:
                break
    if not found:
        return 1
    value = found[variant % len(found)]
    return int(value) if integer or value == int(value) else value


def _bound(
    schema: Mapping[str, Any], closed: str, open_: str, tighter: Callable[..., Any]
) -> tuple[float | None, bool]:
    """The bound on one side and whether it is exclusive, from either keyword (draft 4's
    boolean ``exclusiveMinimum`` makes ``minimum`` exclusive)."""
    edge, is_open = schema.get(closed), schema.get(open_)
    bounds: list[tuple[float, bool]] = []
    if _is_number(edge):
        bounds.append((edge, is_open is True))
    if _is_number(is_open):
        bounds.append((is_open, True))
    if not bounds:
        return None, False
    best = tighter(b for b, _ in bounds)
    return best, any(b == best and o for b, o in bounds)


def _number_candidates(
    low: float | None, high: float | None, step: float | None, hinted: Any, *, integer: bool
) -> Iterator[float]:
    if _is_number(hinted):
        yield hinted
    yield from (1, 0)
    unit: Fraction | None = Fraction(str(step)) if step is not None else None
    if integer:
        unit = Fraction(unit.numerator) if unit is not None else Fraction(1)
    for edge, direction in ((low, 1), (high, -1)):
        if edge is None:
            continue
        if unit is None:
            for offset in (0, 1, 0.5, 0.25, 1e-3):
                yield edge + direction * offset
            continue
        k = math.ceil(Fraction(str(edge)) / unit) if direction > 0 else None
        k = k if k is not None else math.floor(Fraction(str(edge)) / unit)
        for n in range(k, k + 64 * direction, direction):
            yield float(n * unit) if not integer else int(n * unit)
    if low is not None and high is not None:
        yield (low + high) / 2
    if unit is not None:
        for n in range(1, 64):
            yield float(n * unit) if not integer else int(n * unit)
    for n in range(2, 64):
        yield n


def _multiple(value: float, step: float) -> bool:
    """``multipleOf`` as validators compute it (floats by their quotient)."""
    if isinstance(step, float) or isinstance(value, float):
        quotient = value / step
        return math.isfinite(quotient) and int(quotient) == quotient
    return value % step == 0


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _without(schema: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != key}
