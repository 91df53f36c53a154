"""What ``iopctl qualify`` asks of a model and how it judges the answers: the tool call,
the JSON-schema output, and a small JSON-schema validator for both (the subset a
function's parameters and a response format use: type, properties, required, enum,
items, additionalProperties), so iopctl needs no schema library.

Every judgement is a ``Verdict``: passed or not, and why not, in words an operator reads
in the report. A model that cannot do a thing fails its check; that is a result, not an
error of the suite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

WEATHER_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TOOL_MESSAGES: Final = [
    {"role": "user", "content": "What is the weather in Paris, in celsius? Use the tool."}
]
PERSON_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
SCHEMA_MESSAGES: Final = [
    {
        "role": "user",
        "content": "Describe a fictional programmer as JSON with name, age and languages.",
    }
]
_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Why ``value`` does not match ``schema`` (empty: it does)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        wanted = _TYPES.get(kind, (object,))
        is_bool = isinstance(value, bool)
        if not isinstance(value, wanted) or (is_bool and kind in ("integer", "number")):
            return [f"{where} is {type(value).__name__}, not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} is {value!r}, not one of {schema['enum']}"]
    errors: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [
            f"{where}.{name} is missing" for name in schema.get("required", ()) if name not in value
        ]
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{where}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}.{name} is not allowed")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for n, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{n}]")
    return errors


def tool_call_body(model: str) -> dict[str, Any]:
    """A request the model must answer with a call of ``get_weather`` (named in
    ``tool_choice``, so an engine that constrains its output may)."""
    return {
        "model": model,
        "messages": TOOL_MESSAGES,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 64,
    }


def judge_tool_call(answer: dict[str, Any]) -> Verdict:
    """A well-formed call of ``get_weather`` whose arguments match its parameters."""
    message = _message(answer)
    calls = message.get("tool_calls") or []
    if not calls:
        text = str(message.get("content") or "")[:80]
        return Verdict(False, f"no tool call in the answer (it answered text: {text!r})")
    function = (calls[0] or {}).get("function") or {}
    if function.get("name") != "get_weather":
        return Verdict(False, f"called {function.get('name')!r}, not 'get_weather'")
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError:
        return Verdict(False, f"arguments are not JSON: {str(function.get('arguments'))[:80]!r}")
    errors = schema_errors(arguments, WEATHER_TOOL["function"]["parameters"])
    return Verdict(not errors, "; ".join(errors[:3]))


def json_schema_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": SCHEMA_MESSAGES,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        "temperature": 0,
        "max_tokens": 256,
    }


def judge_json_schema(answer: dict[str, Any]) -> Verdict:
    """The answer's text parses as JSON and validates against ``PERSON_SCHEMA``."""
    text = str(_message(answer).get("content") or "")
    try:
        value = json.loads(text)
    except ValueError:
        if _finish(answer) == "length":
            return Verdict(
                False, f"the answer was cut at max_tokens before its JSON closed: {text[:60]!r}"
            )
        return Verdict(False, f"the answer is not JSON: {text[:80]!r}")
    errors = schema_errors(value, PERSON_SCHEMA)
    return Verdict(not errors, "; ".join(errors[:3]))


def _finish(answer: dict[str, Any]) -> str:
    return str((answer.get("choices") or [{}])[0].get("finish_reason") or "")


def _message(answer: dict[str, Any]) -> dict[str, Any]:
    choices = answer.get("choices") or [{}]
    message = choices[0].get("message") or {}
    return message if isinstance(message, dict) else {}
