"""``@record``: an immutable value type for the type checker, a plain slotted dataclass at run time.

The records built on every run or every streamed chunk (``Delta``, ``ExecutionSpec``,
``RunRecord`` ...) would be ``@dataclass(frozen=True, slots=True)``, but a frozen
dataclass's ``__init__`` stores each field through ``object.__setattr__`` (a frozen
class refuses plain assignment), which makes building one about five times slower
than building the same class unfrozen: some 3 us instead of 0.6 us for a seven-field
``Delta`` on a small machine, for every chunk of every stream.

So the freezing is left to mypy (``dataclass_transform(frozen_default=True)``: an
assignment to a field is a type error, as for a frozen dataclass) and the class
itself is an ordinary ``dataclass(slots=True)``, hashable from its fields as a
frozen one is (``unsafe_hash``). Equality, ``repr``, ``dataclasses.fields`` and
``dataclasses.replace`` are the same; only a run-time assignment, which mypy
already refuses, is no longer stopped at run time.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a value type (see the module docstring)."""
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
