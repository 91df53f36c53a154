"""Runtime control changes through the control-plane link, as JSON-ready dicts for the
admin API (``entrypoints.control_routes``): the one place that knows their protobuf.

The control-plane answers once the change is stored and pushed to every edge
(docs/ARCHITECTURE.md#runtime-control); its refusals become the API's errors here.
"""

from __future__ import annotations

from typing import Any, Protocol

from iop_edge.errors import ControlPlaneUnavailable, InvalidRequest, NotFound
from iop_proto.v1 import runtime_pb2 as pb


class ControlLink(Protocol):
    async def runtime_control(
        self, request: pb.RuntimeControlRequest
    ) -> pb.RuntimeControlResponse: ...


def _control(c: pb.RuntimeControl) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "target": c.target,
        "value": c.value,
        "change_id": c.change_id,
        "changed_by": c.changed_by,
        "changed_at_ms": c.changed_unix_ms,
        "reason": c.reason,
    }


def _change(c: pb.RuntimeControlChange) -> dict[str, Any]:
    return {
        "change_id": c.change_id,
        "at_ms": c.at_unix_ms,
        "changed_by": c.changed_by,
        "kind": c.kind,
        "target": c.target,
        "before": c.before,
        "after": c.after,
        "reason": c.reason,
        "reverts": c.reverts or None,
    }


class ControlDesk:
    """Implements ``ports.ControlDesk`` over the control-plane link."""

    def __init__(self, link: ControlLink) -> None:
        self._link = link

    async def listing(self, changed_by: str, audit_limit: int) -> dict[str, Any]:
        request = pb.RuntimeControlRequest(
            changed_by=changed_by, list_only=True, audit_limit=audit_limit
        )
        return self._answer(await self._link.runtime_control(request))

    async def change(
        self, changed_by: str, kind: str, target: str, value: str, reason: str
    ) -> dict[str, Any]:
        request = pb.RuntimeControlRequest(
            changed_by=changed_by, kind=kind, target=target, value=value, reason=reason
        )
        return self._answer(await self._link.runtime_control(request))

    async def revert(self, changed_by: str, change_id: str, reason: str) -> dict[str, Any]:
        request = pb.RuntimeControlRequest(
            changed_by=changed_by, revert_change_id=change_id, reason=reason
        )
        return self._answer(await self._link.runtime_control(request))

    @staticmethod
    def _answer(answer: pb.RuntimeControlResponse) -> dict[str, Any]:
        if answer.error:
            if answer.error_code == "not_found":
                raise NotFound(answer.error)
            if answer.error_code == "unavailable":
                raise ControlPlaneUnavailable(answer.error)
            raise InvalidRequest(answer.error)
        return {
            "change": _change(answer.change) if answer.HasField("change") else None,
            "controls": [_control(c) for c in answer.controls],
            "audit": [_change(c) for c in answer.audit],
        }
