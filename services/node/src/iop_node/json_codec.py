"""JSON on the per-run path: orjson (a C parser and serialiser) first, ``json`` as the fallback.

orjson is several times faster than the standard library on request bodies,
stream chunks and results, but narrower in what it takes: reading, it refuses a
byte order mark, UTF-16/32 input, lone surrogate escapes (``"\\ud83d"``, which
JavaScript clients produce by cutting a string in the middle of an emoji) and
``NaN``/``Infinity``; writing, it refuses integers beyond 64 bits, non-string
keys, lone surrogates and nesting deeper than 254 levels. Those rare inputs go
through the standard library, so the node reads and forwards what it did before
orjson; only they pay for the second attempt.

Two differences remain: orjson reads an integer beyond 64 bits as a float (as
the edge's orjson would), and writes ``NaN`` and the infinities as ``null``
(they are not JSON; the standard library would write ``NaN``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """The value ``raw`` encodes; raises ``ValueError`` when neither parser reads it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            return json.loads(raw)
        except RecursionError:  # nested too deep for the standard library's scanner
            raise exc from None


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(value, separators=(",", ":")).encode()
