"""The mock's schema instances validate against their schemas (checked by ``jsonschema``,
not by the code that made them): the schemas SDKs and Pydantic really send."""

from __future__ import annotations

import enum
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from iop_node.adapters.mock_schema import instance


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
    jsonschema.validate(instance(schema), schema)


def test_the_same_schema_gives_the_same_instance() -> None:
    schema = Forecast.model_json_schema()
    assert instance(schema) == instance(schema)


def test_a_missing_schema_is_an_empty_object() -> None:
    assert instance(None) == {}
