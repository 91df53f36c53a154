"""The mock's schema instances validate against their schemas (checked by ``jsonschema``,
formats included, not by the code that made them): the schemas SDKs and Pydantic really
send, the tool schemas Codex CLI 0.171, Claude Code 2.1.197 and opencode 1.18 sent
(``agent_tool_schemas.json``, from requests captured against the dev stack), and
schemas hypothesis generates."""

from __future__ import annotations

import datetime
import enum
import json
import re
import urllib.parse
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from iop_node.adapters.mock_schema import COMMAND, FORMATS, instance

AGENT_TOOLS = json.loads((Path(__file__).parent / "agent_tool_schemas.json").read_text())
FORMAT_CHECKER = jsonschema.FormatChecker()


# jsonschema checks these formats only with optional packages: strict checks of our own.
@FORMAT_CHECKER.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    return "T" in value and bool(datetime.datetime.fromisoformat(value))


@FORMAT_CHECKER.checks("time", raises=ValueError)
def _time(value: object) -> bool:
    return not isinstance(value, str) or bool(datetime.time.fromisoformat(value))


@FORMAT_CHECKER.checks("uri")
def _uri(value: object) -> bool:
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    return parts is None or bool(parts.scheme and parts.netloc)


@FORMAT_CHECKER.checks("hostname")
def _hostname(value: object) -> bool:
    label = r"[a-z0-9-]+"
    return not isinstance(value, str) or re.fullmatch(rf"{label}(\.{label})*", value) is not None


@FORMAT_CHECKER.checks("duration")
def _duration(value: object) -> bool:
    shape = r"P(\d+[YMWD])+(T(\d+[HMS])+)?"
    return not isinstance(value, str) or re.fullmatch(shape, value) is not None


def check(value: Any, schema: dict[str, Any]) -> None:
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    validator.check_schema(schema)
    validator(schema, format_checker=FORMAT_CHECKER).validate(value)


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Place(BaseModel):
    city: str = Field(min_length=3)
    country: str | None = None


class Forecast(BaseModel):
    place: Place
    unit: Unit
    days: int = Field(ge=1, le=14)
    hourly: list[float] = Field(min_length=2)
    kind: Literal["daily", "hourly"]
    stops: list[Place] = []
    tags: tuple[str, int]


class Tree(BaseModel):
    name: str
    children: list[Tree] = []


SCHEMAS: list[dict[str, Any]] = [
    {},
    {"type": "object", "properties": {}},
    {"type": "string", "format": "date-time"},
    {"type": "integer", "exclusiveMinimum": 5, "multipleOf": 3},
    {"type": "number", "minimum": -2.5, "maximum": -1},
    {"type": ["null", "boolean"]},
    {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 2}]},
    {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"const": 7}}, "required": ["b"]},
        ]
    },
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 3},
    Forecast.model_json_schema(),
    Tree.model_json_schema(),
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_instance_validates(schema: dict[str, Any]) -> None:
    check(instance(schema), schema)


@pytest.mark.parametrize("tool", AGENT_TOOLS, ids=lambda t: f"{t['agent']}-{t['tool']}")
def test_agents_tool_arguments_validate(tool: dict[str, Any]) -> None:
    check(instance(tool["schema"]), tool["schema"])


def agent_tool(agent: str, name: str) -> dict[str, Any]:
    return next(t["schema"] for t in AGENT_TOOLS if (t["agent"], t["tool"]) == (agent, name))


@pytest.mark.parametrize(
    ("agent", "tool", "arguments"),
    [
        ("codex", "exec_command", {"cmd": COMMAND}),
        ("claude-code", "Bash", {"command": COMMAND}),
        ("claude-code", "Read", {"file_path": "."}),
        ("claude-code", "WebSearch", {"query": "iop-mock"}),
        ("opencode", "bash", {"command": COMMAND, "description": "mock"}),
        ("opencode", "glob", {"pattern": "iop-mock"}),
        ("opencode", "read", {"filePath": "."}),
    ],
)
def test_an_agent_gets_arguments_it_can_run_harmlessly(
    agent: str, tool: str, arguments: dict[str, Any]
) -> None:
    schema = agent_tool(agent, tool)
    assert instance(schema) == {k: v for k, v in arguments.items() if k in schema["required"]}


def test_a_command_array_is_an_argv_and_a_timeout_a_usable_number() -> None:
    schema = {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
            "timeout_ms": {"type": "integer", "exclusiveMinimum": 0},
            "run_in_background": {"type": "boolean"},
        },
        "required": ["command", "workdir", "timeout_ms", "run_in_background"],
        "additionalProperties": False,
    }
    assert instance(schema) == {
        "command": ["echo", "iop-mock"],
        "workdir": ".",
        "timeout_ms": 10000,
        "run_in_background": False,
    }


def test_optional_properties_are_left_out_unless_min_properties_wants_them() -> None:
    properties = {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}
    assert instance({"type": "object", "properties": properties, "required": ["b"]}) == {"b": 1}
    wider = {"type": "object", "properties": properties, "required": ["b"], "minProperties": 2}
    assert instance(wider) == {"b": 1, "a": "mock"}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # opencode's (zod's) positive integer: both bounds kinds on one side
        ({"type": "integer", "minimum": -(2**53) + 1, "exclusiveMinimum": 0}, 1),
        ({"type": "integer", "exclusiveMinimum": 1, "maximum": 2}, 2),
        ({"type": "integer", "minimum": 0.2, "exclusiveMaximum": 1.5}, 1),
        ({"type": "integer", "minimum": 7, "multipleOf": 5}, 10),
        ({"type": "integer", "minimum": 1, "multipleOf": 2.5}, 5),
        ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5}, 0.25),
        ({"type": "number", "minimum": 2.5, "maximum": 2.5}, 2.5),
        ({"type": "number", "exclusiveMinimum": 10, "multipleOf": 0.75}, 10.5),
        ({"type": "integer", "minimum": -5, "maximum": -3}, -5),
        ({"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"}, "AAA-00"),
        ({"type": "string", "pattern": "^(foo|bar)_[0-9]+$"}, "foo_0"),
        ({"type": "string", "minLength": 6, "maxLength": 8}, "mockxx"),
        ({"type": "string", "maxLength": 2}, "mo"),
        (
            {"type": "array", "items": {"type": "integer"}, "minItems": 3, "uniqueItems": True},
            [1, 0, 2],
        ),
        ({"enum": ["red", "green"]}, "red"),
        ({"const": {"x": [1]}}, {"x": [1]}),
    ],
)
def test_bounds_and_patterns_are_met(schema: dict[str, Any], expected: Any) -> None:
    assert instance(schema) == expected
    check(expected, schema)


def test_draft_4_boolean_exclusive_bounds() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 1, "exclusiveMinimum": True, "maximum": 3},
            "pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]},
        },
        "required": ["n", "pair"],
    }
    assert instance(schema) == {"n": 2, "pair": ["mock", 1]}
    check(instance(schema), schema)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_value_checks(name: str) -> None:
    check(instance({"type": "string", "format": name}), {"type": "string", "format": name})


def test_refs_any_of_and_one_of_pick_a_valid_branch() -> None:
    schema = {
        "$defs": {
            "cat": {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
                "additionalProperties": False,
            },
            "dog": {"properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
        },
        "type": "object",
        "properties": {
            "pet": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "format": "email"}]},
        },
        "required": ["pet", "note"],
    }
    assert instance(schema) == {"pet": {"kind": "cat", "lives": 1}, "note": "mock@example.com"}
    check(instance(schema), schema)


# -- generated schemas ------------------------------------------------------------------

NAMES = ("command", "cmd", "path", "file_path", "workdir", "pattern", "timeout", "a", "b", "c")
OPEN_PATTERNS = (  # any length from a few characters up
    "^[a-z]+$",
    "^(foo|bar)_[0-9]+$",
    "mock",
    "^v\\d+\\.\\d+\\.\\d+$",
    "^[^\\s@]+@[^\\s@]+$",
    "^\\w+(\\.\\w+)*$",
)
FIXED_PATTERNS = ("^\\d{3}-\\d{4}$", "^[A-Z][a-z]{2,5}$", "^[a-f0-9]{8}$", "^#[0-9a-fA-F]{6}$")
STEPS = (2, 3, 5, 0.5, 0.25, 0.1, 2.5)


@st.composite
def strings(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    kind = draw(st.sampled_from(["plain", "format", "pattern", "fixed"]))
    if kind == "format":
        schema["format"] = draw(st.sampled_from(sorted(FORMATS)))
        return schema
    if kind == "fixed":
        schema["pattern"] = draw(st.sampled_from(FIXED_PATTERNS))
        return schema
    if kind == "pattern":
        schema["pattern"] = draw(st.sampled_from(OPEN_PATTERNS))
    low = draw(st.none() | st.integers(0, 12))
    if low is not None:
        schema["minLength"] = low
    if draw(st.booleans()) and kind == "plain":
        schema["maxLength"] = (low or 0) + draw(st.integers(0, 6))
    return schema


@st.composite
def numbers(draw: st.DrawFn) -> dict[str, Any]:
    integer = draw(st.booleans())
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    step = draw(st.none() | st.sampled_from(STEPS))
    if step is not None:
        schema["multipleOf"] = step
    floats = st.floats(-1e6, 1e6, allow_nan=False).map(lambda f: round(f, 3))
    bound = st.integers(-(10**6), 10**6) | floats
    low = draw(st.none() | bound)
    if low is not None:
        schema[draw(st.sampled_from(["minimum", "exclusiveMinimum"]))] = low
    if draw(st.booleans()):
        # room for a value that fits every other keyword
        gap = 2 + (step or 0) * 2 + draw(st.integers(0, 50))
        high = (low if low is not None else draw(bound)) + gap
        schema[draw(st.sampled_from(["maximum", "exclusiveMaximum"]))] = high
    return schema


LEAVES = (
    strings()
    | numbers()
    | st.just({"type": "boolean"})
    | st.just({"type": "null"})
    | st.lists(st.text(max_size=5) | st.integers(), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    )
    | (st.text(max_size=5) | st.integers() | st.booleans()).map(lambda value: {"const": value})
)


def composite(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def objects(draw: st.DrawFn) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(NAMES), max_size=5, unique=True))
        properties = {name: draw(children) for name in names}
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        schema["required"] = [n for n in names if draw(st.booleans())]
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        if names and draw(st.booleans()):
            schema["minProperties"] = draw(st.integers(0, len(names)))
        return schema

    @st.composite
    def arrays(draw: st.DrawFn) -> dict[str, Any]:
        unique = draw(st.booleans())
        # distinct items need an item schema with room for them
        roomy = numbers().filter(lambda s: len(s) == 1) | st.just({"type": "string"})
        items = draw(roomy if unique else children)
        schema: dict[str, Any] = {"type": "array", "items": items}
        low = draw(st.integers(0, 4))
        schema["minItems"] = low
        if draw(st.booleans()):
            schema["maxItems"] = low + draw(st.integers(0, 3))
        if unique:
            schema["uniqueItems"] = True
        return schema

    @st.composite
    def one_of(draw: st.DrawFn) -> dict[str, Any]:
        # options that no value satisfies twice: distinct tags of a discriminated union
        tags = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=3, unique=True))
        options = []
        for tag in tags:
            option = draw(objects())
            option["properties"]["kind"] = {"const": tag}
            option["required"] = ["kind", *option["required"]]
            options.append(option)
        return {"oneOf": options}

    @st.composite
    def referenced(draw: st.DrawFn) -> dict[str, Any]:
        return {"$defs": {"it": draw(children)}, "$ref": "#/$defs/it"}

    @st.composite
    def all_of(draw: st.DrawFn) -> dict[str, Any]:
        first, second = draw(objects()), draw(objects())
        clash = set(first["properties"]) & set(second["properties"])
        for name in clash:
            del second["properties"][name]
        second["required"] = [n for n in second["required"] if n not in clash]
        first.pop("additionalProperties", None)
        second.pop("additionalProperties", None)
        return {"allOf": [first, second]}

    any_of = st.lists(children, min_size=1, max_size=3).map(lambda options: {"anyOf": options})
    return objects() | arrays() | one_of() | any_of | referenced() | all_of()


def hoisted(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with each generated ``{"$defs": {"it": ...}, "$ref": "#/$defs/it"}``
    moved into the root's ``$defs`` under a name of its own: ``#/...`` is read from the
    root."""
    definitions: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: walk(value) for key, value in node.items()}
        if "$defs" in node:
            name = f"d{len(definitions)}"
            definitions[name] = node.pop("$defs")["it"]
            node["$ref"] = f"#/$defs/{name}"
        return node

    root = walk(schema)
    return {**root, "$defs": definitions} if definitions else root


SCHEMA_TREES = st.recursive(LEAVES, composite, max_leaves=12).map(hoisted)


@settings(max_examples=300, deadline=None)
@given(SCHEMA_TREES)
def test_generated_schemas_get_valid_instances(schema: dict[str, Any]) -> None:
    check(instance(schema), schema)


def test_the_same_schema_gives_the_same_instance() -> None:
    schema = Forecast.model_json_schema()
    assert instance(schema) == instance(schema)


def test_a_missing_schema_is_an_empty_object() -> None:
    assert instance(None) == {}
