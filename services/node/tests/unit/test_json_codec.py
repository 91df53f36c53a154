"""json_codec: orjson's speed, and what only the standard library reads or writes still works."""

from __future__ import annotations

import json
import math

import pytest

from iop_node import json_codec


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"a": [1, 2.5, "x", null, true]}', {"a": [1, 2.5, "x", None, True]}),
        ('{"é": "ü"}'.encode(), {"é": "ü"}),
        (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a byte order mark
        ('{"a": 1}'.encode("utf-16"), {"a": 1}),
        (b'{"a": "\\ud83d"}', {"a": "\ud83d"}),  # a lone surrogate escape
        (b'{"a": 1, "a": 2}', {"a": 2}),  # the last one wins, as before
    ],
)
def test_loads_reads_what_the_standard_library_reads(raw: bytes, value: object) -> None:
    assert json_codec.loads(raw) == value
    assert json_codec.loads(raw) == json.loads(raw)


def test_loads_still_takes_the_constants_python_writes() -> None:
    value = json_codec.loads(b'{"a": NaN, "b": -Infinity}')
    assert math.isnan(value["a"])
    assert value["b"] == -math.inf


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
    assert json.loads(raw) == json.loads(json.dumps(value))


def test_dumps_writes_utf8_not_escapes() -> None:
    assert json_codec.dumps({"k": "héllo"}) == '{"k":"héllo"}'.encode()


def test_integers_beyond_64_bits_are_read_as_floats() -> None:
    # A documented difference from the standard library (the edge reads them so too).
    assert json_codec.loads(b"[18446744073709551616]") == [float(2**64)]
    assert json_codec.loads(b"[18446744073709551615]") == [2**64 - 1]
