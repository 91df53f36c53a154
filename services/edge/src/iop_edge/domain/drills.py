"""The mock provider's failure drills (``iop_mock``, services/node adapters/mock.py): who
may ask for one.

A drill makes the mock fail, hang or wait on demand (``fail``, ``status``,
``after_tokens``, ``delay_ms``), which is how tests and operators rehearse failover,
ejection and drains. Asked by any tenant it is a lever on everyone else: failures that
look like the provider's, slots held for as long as the request allows. So the edge
honours a drill only from an operator key, or from every caller where the fleet is
a test fleet (the edge's ``mock_drills`` setting, off by default); any other request
that asks one is refused before it takes a slot. ``fill`` (answer ``max_tokens``
tokens) asks nothing of anyone else and stays open to all.

Whoever asked it, a drill's failure is the request's doing, never counted against the
provider (``faults.fault_of``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from iop_edge.domain.fleet import ApiKeyEntry

HOOK: Final = "iop_mock"
DRILL_FIELDS: Final = frozenset({"fail", "status", "after_tokens", "delay_ms"})
"""The members of ``iop_mock`` that make a drill (the mock's ``FailureDrill``, less ``fill``)."""


def asks_drill(body: Mapping[str, Any]) -> bool:
    """The request body asks the mock for a drill. A hook that is no object asks none
    here: the mock refuses it as an invalid request."""
    hook = body.get(HOOK)
    return isinstance(hook, Mapping) and not DRILL_FIELDS.isdisjoint(hook)


def may_drill(key: ApiKeyEntry | None, open_to_all: bool) -> bool:
    """Whether a caller with ``key`` (``None``: the open API, no keys configured) may ask
    for a drill; ``open_to_all``: the edge's ``mock_drills`` setting."""
    return open_to_all or (key is not None and key.operator)


REFUSAL: Final = (
    "The 'iop_mock' failure drills (fail, status, after_tokens, delay_ms) are honoured only"
    " for operator API keys, or on an edge whose settings say mock_drills: true."
)
