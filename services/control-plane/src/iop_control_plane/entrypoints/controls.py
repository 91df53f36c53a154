"""An operator's runtime control change, as an edge forwards it (``RuntimeControlRequest``):
checked against the fleet, stored with its audit entry, pushed to every edge, answered.

The edge authenticated the operator key and names it in ``changed_by``; the control-plane
trusts its edges for that as it trusts them with node registrations (their link is mTLS,
edge certificates only). Changes are taken one at a time: each is a compare and set over
the control in force (``CredentialStore.record_control_change``), so two operators
racing on one target get one change and one "changed meanwhile", never a lost update.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime

from loguru import logger

from iop_control_plane.adapters.controls_proto import change_to_proto, controls_to_proto
from iop_control_plane.authority import FleetAuthority
from iop_control_plane.domain.controls import (
    AUDIT_DEFAULT,
    AUDIT_MAX,
    ControlChange,
    ControlRefused,
    check_change_id,
    checked_value,
    new_change_id,
)
from iop_control_plane.ports import CredentialStore
from iop_proto.postgres import StorageUnavailable
from iop_proto.v1 import runtime_pb2 as pb


class ControlDesk:
    """Answers ``RuntimeControlRequest``s for every edge session."""

    def __init__(
        self,
        authority: FleetAuthority,
        store: CredentialStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._authority = authority
        self._store = store
        self._clock = clock
        self._lock = asyncio.Lock()

    async def answer(self, request: pb.RuntimeControlRequest) -> pb.RuntimeControlResponse:
        try:
            async with self._lock:
                change = None if request.list_only else await self._change(request)
            limit = min(request.audit_limit or AUDIT_DEFAULT, AUDIT_MAX)
            audit = await self._store.control_audit(limit)
        except ControlRefused as exc:
            return pb.RuntimeControlResponse(error=str(exc), error_code=exc.code)
        except StorageUnavailable as exc:
            logger.warning("runtime control not changed: {}", exc)
            return pb.RuntimeControlResponse(error=str(exc), error_code="unavailable")
        answer = pb.RuntimeControlResponse(
            controls=controls_to_proto(self._authority.controls),
            audit=[change_to_proto(entry) for entry in audit],
        )
        if change is not None:
            answer.change.CopyFrom(change_to_proto(change))
        return answer

    async def _change(self, request: pb.RuntimeControlRequest) -> ControlChange | None:
        """Store and push the change asked for; ``None`` when it changes nothing."""
        reverts = ""
        if request.revert_change_id:
            reverts = check_change_id(request.revert_change_id)
            found = await self._store.control_audit(1, reverts)
            if not found:
                raise ControlRefused(f"no change {reverts!r}", "not_found")
            kind, target, value = found[0].kind, found[0].target, found[0].before
        else:
            kind, target, value = request.kind, request.target, request.value
        value = checked_value(kind, target, value, self._authority.fleet)
        current = {(c.kind, c.target): c.value for c in await self._store.runtime_controls()}
        before = current.get((kind, target), "")
        if before == value:
            return None
        change = ControlChange(
            change_id=new_change_id(),
            at=datetime.fromtimestamp(self._clock(), UTC),
            changed_by=request.changed_by or "?",
            kind=kind,
            target=target,
            before=before,
            after=value,
            reason=request.reason,
            reverts=reverts,
        )
        if not await self._store.record_control_change(change):
            raise ControlRefused(f"{kind} {target} changed meanwhile; look and try again")
        logger.info(
            "runtime control {} {}: {!r} -> {!r} by {} ({}{})",
            kind,
            target,
            before,
            value,
            change.changed_by,
            change.change_id,
            f", reverting {reverts}" if reverts else "",
        )
        await self._authority.controls_changed(await self._store.runtime_controls())
        return change
