"""The ``x-iop-provider`` header: an operator's request pinned to one provider of its model
(``domain.pin``; docs/ARCHITECTURE.md#qualification-reports).

Like ``x-iop-priority`` (queue_share.py) it is an operator's: a tenant's key that
sends it is refused (403), not ignored; the open API is the operator's too. Absent, it
costs one header lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.errors import InvalidRequest, OperatorOnly

PIN_HEADER: Final = "x-iop-provider"


def provider_pin(key: ApiKeyEntry | None, headers: Mapping[str, str]) -> str:
    """The provider the request is pinned to (``PROVIDER`` or ``NODE/PROVIDER``); "" when
    it is not."""
    asked = headers.get(PIN_HEADER)
    if asked is None:
        return ""
    if key is not None and not key.operator:
        raise OperatorOnly(
            f"The {PIN_HEADER} header is honoured only for operator API keys: it pins a"
            " request to one provider, for qualification."
        )
    pin = asked.strip()
    if not pin or pin.endswith("/") or pin.count("/") > 1:
        raise InvalidRequest(f"The {PIN_HEADER} header must be PROVIDER or NODE/PROVIDER.")
    return pin
