"""A request's turn in its model's queue (docs/ARCHITECTURE.md#fair-queueing): its key,
the key's weight and priority, and the ``x-iop-priority`` header of an operator key.

The header is an operator's: a tenant's key that sends it is refused (403), not
ignored, so nobody believes they were served at a priority they were not given; the
open API (no keys configured: loopback clients by default) is the operator's too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.domain.queue import NO_SHARE, Share
from iop_edge.errors import InvalidRequest, PriorityNotAllowed

PRIORITY_HEADER: Final = "x-iop-priority"
_INT32: Final = 2**31


def queue_share(key: ApiKeyEntry | None, headers: Mapping[str, str]) -> Share:
    """The request's ``Share``: the key's id, weight and priority, the priority replaced
    by the header's when an operator key (or the open API) sends one."""
    asked = headers.get(PRIORITY_HEADER)
    if asked is not None:
        if key is not None and not key.operator:
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
    else:
        return NO_SHARE
    if key is None:
        return Share(priority=priority)
    return Share(key=key.key_id, weight=max(1, key.weight), priority=priority)
