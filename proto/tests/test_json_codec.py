"""json_codec: orjson's speed, and exactly what the standard library reads and writes."""

from __future__ import annotations

import json
import math

import pytest

from iop_proto import json_codec


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"a": [1, 2.5, "x", null, true]}', {"a": [1, 2.5, "x", None, True]}),
        ('{"é": "ü"}'.encode(), {"é": "ü"}),
        (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a byte order mark
        ('{"a": 1}'.encode("utf-16"), {"a": 1}),
        (b'{"a": "\\ud83d"}', {"a": "\ud83d"}),  # a lone surrogate escape
        (b'{"a": 1, "a": 2}', {"a": 2}),  # the last one wins, as before
        (b'{"seed": 123456789012345678901234567890}', {"seed": 123456789012345678901234567890}),
        (b"[18446744073709551616, -18446744073709551617]", [2**64, -(2**64) - 1]),
        (b"[18446744073709551615]", [2**64 - 1]),
        (b'{"text": "order 12345678901234567890123"}', {"text": "order 12345678901234567890123"}),
        ('{"a": 99999999999999999999}', {"a": 99999999999999999999}),  # text, not bytes
    ],
)
def test_loads_reads_what_the_standard_library_reads(raw: bytes | str, value: object) -> None:
    got = json_codec.loads(raw)
    assert got == value
    assert got == json.loads(raw)
    assert [type(x) for x in _leaves(got)] == [type(x) for x in _leaves(value)]


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def test_loads_takes_the_constants_python_writes_unless_told_not_to() -> None:
    value = json_codec.loads(b'{"a": NaN, "b": -Infinity}')
    assert math.isnan(value["a"])
    assert value["b"] == -math.inf
    for raw in (b'{"a": NaN}', b'{"a": Infinity}', b"[-Infinity]"):
        with pytest.raises(ValueError, match="is not valid JSON"):
            json_codec.loads(raw, allow_nan=False)


@pytest.mark.parametrize("raw", [b"", b"{", b"{'a': 1}", b"\xff\xfe\xfd", b"[" * 100_000])
def test_loads_raises_value_error_for_what_is_not_json(raw: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the contract is the built-in type
        json_codec.loads(raw)


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, "x", None, True], "é": "ü"},
        {"big": 2**70, "small": -(2**70)},
        {"cut": "\ud83d"},
        {1: "integer key"},
        [[[[[[[[[[0]]]]]]]]]] * 3,
        {"deep": json.loads("[" * 300 + "]" * 300)},  # past orjson's 254 levels
    ],
)
def test_dumps_writes_compact_json_that_reads_back(value: object) -> None:
    raw = json_codec.dumps(value)
    assert isinstance(raw, bytes)
    assert b", " not in raw
    assert b": " not in raw
    assert json_codec.loads(raw) == json.loads(json.dumps(value))


def test_dumps_writes_utf8_not_escapes() -> None:
    assert json_codec.dumps({"k": "héllo"}) == '{"k":"héllo"}'.encode()


def test_dumps_writes_nan_and_infinities_as_null_on_both_paths() -> None:
    assert json_codec.dumps({"x": math.nan, "y": [math.inf]}) == b'{"x":null,"y":[null]}'
    slow = json_codec.dumps({"x": math.nan, "big": 2**70})  # the fallback writes this one
    assert json.loads(slow) == {"x": None, "big": 2**70}


@pytest.mark.parametrize("depth", [1, 2, 63, 64])
def test_loads_takes_nesting_up_to_max_depth(depth: int) -> None:
    raw = '{"a":' * (depth - 1) + "[]" + "}" * (depth - 1)
    value = json_codec.loads(raw, max_depth=json_codec.MAX_DEPTH)
    assert json_codec.loads(json_codec.dumps(value)) == value  # and it writes again


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 65 + b"]" * 65,
        b'{"messages": [{"content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}",  # reads, but not
        b"[" * 1100 + b"]" * 1100,  # past orjson's own reading limit
        b"[" * 100_000,  # not even JSON: too deep before it is known to be broken
        b'{"x": "\\ud83d", "y": ' + b"[" * 900 + b"]" * 900 + b"}",  # the slow path
    ],
)
def test_loads_refuses_nesting_past_max_depth_naming_it(raw: bytes) -> None:
    with pytest.raises(json_codec.JsonTooDeep, match="deeper than 64 levels") as refused:
        json_codec.loads(raw, max_depth=json_codec.MAX_DEPTH)
    assert refused.value.max_depth == json_codec.MAX_DEPTH
    assert isinstance(refused.value, ValueError)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    raw = json.dumps({"text": "[" * 500 + "{" * 500, "list": [[1], [2], [3]] * 100})
    assert json_codec.loads(raw, max_depth=3) == json.loads(raw)
