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

Nesting: ``loads(raw, max_depth=MAX_DEPTH)`` refuses input nested deeper than
``MAX_DEPTH`` (``JsonTooDeep``). Anything read within that depth can always be
written again: orjson writes up to 254 levels and the standard library's
fallback stays far inside Python's recursion limit. Without a limit, a value
nested 1,000 levels deep reads (orjson reads 1,024) but cannot be written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final, NoReturn

import orjson

MAX_DEPTH: Final = 64
"""Nesting (objects and arrays) that API input may have: far beyond real requests (a chat
message's content part is at level 5, an OpenAI tool's JSON schema rarely passes 20), far
below what writing survives (orjson: 254 levels)."""

_LONG_DIGITS = re.compile(rb"\d{20}")
_LONG_DIGITS_TEXT = re.compile(r"\d{20}")
"""20 digits in a row: maybe an integer past 64 bits (2**64 has 20), which orjson
would turn into a float. A long number inside a string only costs a second parse."""


class JsonTooDeep(ValueError):
    """The input is nested deeper than the ``max_depth`` it was read with."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"JSON nested deeper than {max_depth} levels")
        self.max_depth = max_depth


def loads(raw: bytes | str, *, allow_nan: bool = True, max_depth: int | None = None) -> Any:
    """The value ``raw`` encodes, as ``json.loads`` reads it; ``ValueError`` otherwise.

    ``allow_nan=False`` refuses ``NaN`` and the infinities (not JSON), as an API
    taking JSON from clients should. ``max_depth``: input nested deeper raises
    ``JsonTooDeep``; the check costs no second parse (a count of brackets, and
    only when there are more of them than the limit, one walk of the containers).
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        value = _standard_loads(raw, allow_nan, exc, max_depth)
    else:
        long_digits = _LONG_DIGITS if isinstance(raw, bytes) else _LONG_DIGITS_TEXT
        if long_digits.search(raw):  # type: ignore[arg-type]
            value = _standard_loads(raw, allow_nan, None, max_depth)  # exact integers
    if max_depth is not None:
        # The opening brackets, strings' included, bound the nesting from above: only
        # input with more of them than the limit can be too deep, and only that is walked.
        if isinstance(raw, bytes):
            brackets = raw.count(b"[") + raw.count(b"{")
        else:
            brackets = raw.count("[") + raw.count("{")
        if brackets > max_depth and _deeper_than(value, max_depth):
            raise JsonTooDeep(max_depth)
    return value


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON: UTF-8 from orjson, ASCII escapes from the fallback."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(_finite(value), separators=(",", ":")).encode()


def _standard_loads(
    raw: bytes | str, allow_nan: bool, fast_error: ValueError | None, max_depth: int | None
) -> Any:
    try:
        if allow_nan:
            return json.loads(raw)
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # nested too deep for the standard library's scanner
        if max_depth is not None:
            raise JsonTooDeep(max_depth) from None  # ~1,000 levels: far past any limit
        raise fast_error or ValueError("JSON nested too deeply") from None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` levels: one walk, level by level, that
    touches each container once and stops at the first level past the limit."""
    level = [value] if type(value) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            below.extend(item for item in items if type(item) in (dict, list))
        level = below
    return False


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
