"""Counting for ``tools/hardening/body_passes.py``: the request body's parses and writes.

Loaded into a service only through the ``PYTHONPATH`` that script gives its stack, and
idle unless ``BODY_PASSES_DIR`` is set. It wraps the JSON functions the services call
(``iop_proto.json_codec.loads``/``dumps`` and the standard library's ``json``) and, for
each call whose input (a parse) or output (a write) holds the marker the script puts in
its request's prompt, appends one line ``<parse|write> <module>:<function>`` to
``<pid>.log`` in that folder. The services' code is unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

_DIR = os.environ.get("BODY_PASSES_DIR", "")
_MARKER = os.environ.get("BODY_PASSES_MARKER", "").encode()


def _note(kind: str, data: Any) -> None:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if _MARKER not in raw:
        return
    caller = sys._getframe(2)
    where = f"{caller.f_globals.get('__name__')}:{caller.f_code.co_qualname}"
    with (Path(_DIR) / f"{os.getpid()}.log").open("a") as log:
        log.write(f"{kind} {where}\n")


def _wrap(module: Any, name: str, kind: str) -> None:
    original = getattr(module, name)

    def counted(value: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(value, *args, **kwargs)
        if isinstance(value, (bytes, bytearray, memoryview, str)) and kind == "parse":
            _note(kind, value)
        elif kind == "write" and isinstance(result, (bytes, str)):
            _note(kind, result)
        return result

    setattr(module, name, counted)


if _DIR and _MARKER:
    from iop_proto import json_codec

    _wrap(json_codec, "loads", "parse")
    _wrap(json_codec, "dumps", "write")
    _wrap(json, "loads", "parse")
    _wrap(json, "dumps", "write")
