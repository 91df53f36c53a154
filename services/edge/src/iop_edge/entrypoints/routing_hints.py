"""What a request asks of its routing, read in one place from its headers and body: the
fields of its run (``RunSpec``) that say where and when it may run.

- its session (``domain.session_key``: what coding agents already send), scoped to its
  API key, for cache affinity (docs/ARCHITECTURE.md#cache-affinity);
- its turn in its model's queue (docs/ARCHITECTURE.md#fair-queueing): its key's id,
  weight and priority, the priority replaced by an ``x-iop-priority`` header;
- ``x-iop-provider``: the one provider of its model it runs on (``domain.pin``;
  docs/ARCHITECTURE.md#qualification-reports);
- a failure drill of the mock provider (``domain.drills``), refused unless allowed.

Both headers are an operator's: a tenant's key that sends one is refused (403), not
ignored, so nobody believes they were served at a priority, or by a provider, they were
not given; the open API (no keys configured: loopback clients by default) is the
operator's too. Absent, each costs one header lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from iop_edge.domain import drills
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.domain.queue import Share
from iop_edge.domain.session_key import session_key
from iop_edge.errors import InvalidRequest, OperatorOnly, PriorityNotAllowed

PRIORITY_HEADER: Final = "x-iop-priority"
PIN_HEADER: Final = "x-iop-provider"
_INT32: Final = 2**31


def routing_hints(
    key: ApiKeyEntry | None,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    run_body: Mapping[str, Any],
    *,
    mock_drills: bool = False,
) -> dict[str, Any]:
    """The ``RunSpec`` fields the request's hints set, and only those: ``session`` and
    ``scope``, ``share``, ``pin``, ``drill``.

    ``body`` is the client's (where agents name their session), ``run_body`` the run's
    (its dialect's reading of it, which carries a drill's hook); ``mock_drills``: the
    edge honours drills from every caller (its ``mock_drills`` setting). Raises
    ``PriorityNotAllowed`` or ``OperatorOnly`` for an operator's header from a tenant's
    key, ``InvalidRequest`` for a malformed header or a drill the caller may not ask.
    """
    hints: dict[str, Any] = {}
    scope = key.key_id if key is not None else ""
    session = session_key(headers, body, scope)
    if session is not None or scope:
        hints["session"], hints["scope"] = session, scope
    operator = key is None or key.operator
    asked = headers.get(PRIORITY_HEADER)
    if asked is not None:
        if not operator:
            raise PriorityNotAllowed(
                f"The {PRIORITY_HEADER} header is honoured only for operator API keys; this"
                " key's priority is set on the key."
            )
        try:
            priority = int(asked.strip())
        except ValueError:
            priority = _INT32  # out of range: refused below
        if not -_INT32 <= priority < _INT32:
            raise InvalidRequest(f"The {PRIORITY_HEADER} header must be an integer (int32).")
    elif key is not None:
        priority = key.priority
    if key is not None:
        hints["share"] = Share(key=key.key_id, weight=max(1, key.weight), priority=priority)
    elif asked is not None:
        hints["share"] = Share(priority=priority)
    pin = headers.get(PIN_HEADER)
    if pin is not None:
        if not operator:
            raise OperatorOnly(
                f"The {PIN_HEADER} header is honoured only for operator API keys: it pins a"
                " request to one provider, for qualification."
            )
        pin = pin.strip()
        if not pin or pin.endswith("/") or pin.count("/") > 1:
            raise InvalidRequest(f"The {PIN_HEADER} header must be PROVIDER or NODE/PROVIDER.")
        hints["pin"] = pin
    if drills.asks_drill(run_body):
        if not drills.may_drill(key, mock_drills):
            raise InvalidRequest(drills.REFUSAL, param=drills.HOOK)
        hints["drill"] = True
    return hints
