"""JSON on the request path: orjson's speed, the standard library's results.

orjson (a C parser and serialiser) is several times faster than ``json`` on
request bodies, results and stream chunks, but narrower. Reading, it refuses a
byte order mark, UTF-16/32 input, lone surrogate escapes (``"\\ud83d"``, which
JavaScript clients produce by cutting a string inside an emoji) and
``NaN``/``Infinity``, and it reads an integer beyond 64 bits as a float, losing
digits. Writing, it refuses integers beyond 64 bits, non-string keys, lone
surrogates and nesting past 254 levels. Every such input goes through the
standard library instead, so ``loads`` returns what ``json.loads`` returns and
``dumps`` writes what reads back the same; only those rare inputs pay twice.

One difference is left, on purpose: ``dumps`` writes ``NaN`` and the infinities
as ``null`` (they are not JSON; the standard library would write ``NaN``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import orjson

_LONG_DIGITS = re.compile(rb"\d{20}")
_LONG_DIGITS_TEXT = re.compile(r"\d{20}")
"""20 digits in a row: maybe an integer past 64 bits (2**64 has 20), which orjson
would turn into a float. A long number inside a string only costs a second parse."""


def loads(raw: bytes | str, *, allow_nan: bool = True) -> Any:
    """The value ``raw`` encodes, as ``json.loads`` reads it; ``ValueError`` otherwise.

    ``allow_nan=False`` refuses ``NaN`` and the infinities (not JSON), as an API
    taking JSON from clients should.
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _standard_loads(raw, allow_nan, exc)
    long_digits = _LONG_DIGITS if isinstance(raw, bytes) else _LONG_DIGITS_TEXT
    if long_digits.search(raw):  # type: ignore[arg-type]
        return _standard_loads(raw, allow_nan, None)  # exact integers
    return value


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON: UTF-8 from orjson, ASCII escapes from the fallback."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(_finite(value), separators=(",", ":")).encode()


def _standard_loads(raw: bytes | str, allow_nan: bool, fast_error: ValueError | None) -> Any:
    try:
        if allow_nan:
            return json.loads(raw)
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # nested too deep for the standard library's scanner
        raise fast_error or ValueError("JSON nested too deeply") from None


def _finite(value: Any) -> Any:
    """``value`` with NaN and the infinities as ``None``, as orjson writes them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")
