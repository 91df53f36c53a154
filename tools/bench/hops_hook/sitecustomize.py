"""Call tracing for ``tools/bench/hops.py``, loaded into a service only when it asks for it.

Python imports ``sitecustomize`` at start-up from ``sys.path``; ``hops.py`` puts this
folder first on the ``PYTHONPATH`` of the stack it starts and sets ``BENCH_HOPS_DIR``.
Without that variable this module does nothing, so it never changes a service that
was not started for the measurement (and the services' code is never touched).

With it, the process waits for two signals:

- ``SIGUSR1``: start recording. ``sys.setprofile`` in the main thread (the event
  loop's), and a flag the profiler of every thread started later checks
  (``threading.setprofile`` is installed at start-up, because Python 3.11 cannot
  set a profiler on a thread that is already running). An empty file
  ``on-<pid>-<n>`` says the recording has begun.
- ``SIGUSR2``: stop, and write ``rec-<pid>-<n>.json``: for each function of
  ``iop_edge``, ``iop_node`` or ``iop_proto`` (not the generated ``iop_proto.v1``)
  that ran, in the order each first ran, its calls and its resumptions (a coroutine
  or generator continuing after an ``await`` or ``yield``; Python's profiler reports
  those as calls too, which would count one coroutine many times), its file and
  first line. Comprehensions and generator expressions are left out: they are lines
  of the function that holds them (Python 3.12 inlines comprehensions).

While recording, every JSON parse and serialisation of at least ``BENCH_HOPS_BODY_MIN``
bytes (``json`` and ``orjson``'s ``loads`` and ``dumps``, wrapped as this module loads,
before any service module or aiohttp binds them) is listed in the record too: which,
its size, and the innermost IOP function that asked for it (past ``iop_proto.json_codec``,
which only chooses the library). The size tells the request body from a stream chunk.

Signals reach the handler when the main thread next runs Python code: uvloop and
asyncio's loop both wake on a signal, so an idle service answers at once.
"""

from __future__ import annotations

import dis
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

_OUT = os.environ.get("BENCH_HOPS_DIR", "")
_PACKAGES = ("iop_edge", "iop_node", "iop_proto")
_SKIPPED_PACKAGES = ("iop_proto.v1",)
_INLINE = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_RESUME = dis.opmap.get("RESUME")

_recording = False
_seq = 0
# code object -> [calls, resumes]; dicts keep insertion order: the order of first runs.
_counts: dict[CodeType, list[int]] = {}
_modules: dict[CodeType, str] = {}
_names: dict[CodeType, str] = {}
_ignored: set[CodeType] = set()
_first_entry: dict[CodeType, int] = {}  # generator-like code: the offset its first RESUME is at
_BODY_MIN = int(os.environ.get("BENCH_HOPS_BODY_MIN", "0") or 0)
_CODEC = "iop_proto.json_codec"  # picks orjson or json: the function that called it is the user
_json: list[dict[str, Any]] = []  # the JSON parses and serialisations of the recording


def _module(frame: FrameType) -> str | None:
    """The frame's module when its functions are recorded, else ``None``."""
    module = frame.f_globals.get("__name__")
    if not isinstance(module, str) or module.split(".", 1)[0] not in _PACKAGES:
        return None
    if module.startswith(_SKIPPED_PACKAGES) or frame.f_code.co_name in _INLINE:
        return None
    return module


def _name(frame: FrameType) -> str:
    """The function's qualified name; for generated code (a dataclass's ``__init__``,
    whose qualname is ``__create_fn__.<locals>.__init__``), its class's name instead."""
    code = frame.f_code
    if code.co_filename.startswith("<") and "self" in code.co_varnames[: code.co_argcount]:
        owner = frame.f_locals.get("self")
        if owner is not None:
            return f"{type(owner).__qualname__}.{code.co_name}"
    return code.co_qualname


def _is_first_entry(frame: FrameType) -> bool:
    """Whether a generator-like frame starts now, rather than resuming.

    Python 3.11 runs a coroutine's first lines up to ``RESUME 0`` and continues after
    each ``await`` at ``RESUME 1-3``: the first 'call' event is the one at ``RESUME 0``.
    """
    code = frame.f_code
    start = _first_entry.get(code)
    if start is None:
        start = -1
        for instruction in dis.get_instructions(code):
            if instruction.opcode == _RESUME and instruction.arg == 0:
                start = instruction.offset
                break
        _first_entry[code] = start
    return start < 0 or frame.f_lasti == start


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call" or not _recording:
        return
    code = frame.f_code
    if code in _ignored:
        return
    counts = _counts.get(code)
    if counts is None:
        module = _module(frame)
        if module is None:
            _ignored.add(code)
            return
        _modules[code] = module
        _names[code] = _name(frame)
        counts = _counts[code] = [0, 0]
    if code.co_flags & _GENERATOR_FLAGS and not _is_first_entry(frame):
        counts[1] += 1
    else:
        counts[0] += 1


def _entry(code: CodeType, counts: list[int]) -> dict[str, Any]:
    return {
        "module": _modules[code],
        "qualname": _names[code],
        "calls": counts[0],
        "resumes": counts[1],
        "file": code.co_filename,
        "line": code.co_firstlineno,
    }


def _caller() -> str:
    """The innermost IOP function on the stack (coroutines awaiting one another included)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__")
        if isinstance(module, str) and module.split(".", 1)[0] in _PACKAGES and module != _CODEC:
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "(no IOP function)"


def _size(value: Any) -> int:
    return len(value) if isinstance(value, bytes | bytearray | memoryview | str) else -1


def _traced(op: str, library: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, listing each call of body size while recording (a failed one is not:
    ``json_codec`` then retries with the other library, which is listed)."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _recording:
            size = _size(args[0] if args else None) if op == "parse" else _size(result)
            if size >= _BODY_MIN:
                entry = {"op": op, "library": library, "bytes": size, "function": _caller()}
                _json.append(entry)
        return result

    return traced


def _wrap_json() -> None:
    import json

    json.loads = _traced("parse", "json", json.loads)
    json.dumps = _traced("serialise", "json", json.dumps)
    try:
        import orjson
    except ImportError:
        return
    orjson.loads = _traced("parse", "orjson", orjson.loads)
    orjson.dumps = _traced("serialise", "orjson", orjson.dumps)


def _start(signum: int, frame: FrameType | None) -> None:
    global _recording, _seq
    _seq += 1
    _counts.clear()
    _json.clear()
    _recording = True
    sys.setprofile(_profile)
    Path(_OUT, f"on-{os.getpid()}-{_seq}").touch()


def _stop(signum: int, frame: FrameType | None) -> None:
    global _recording
    sys.setprofile(None)
    _recording = False
    record = {
        "pid": os.getpid(),
        "argv": sys.argv,
        "functions": [_entry(code, counts) for code, counts in list(_counts.items())],
        "json": list(_json),
    }
    final = Path(_OUT, f"rec-{os.getpid()}-{_seq}.json")
    partial = final.with_suffix(".part")
    partial.write_text(json.dumps(record))
    partial.rename(final)  # the reader never sees half a file


if _OUT:
    _wrap_json()
    threading.setprofile(_profile)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
