"""The runtime control admin API (docs/ARCHITECTURE.md#runtime-control), for operator
keys only (403 for any other, as the fleet's history):

- ``GET /iop/v1/controls``: the controls in force and the audit trail (``?audit=N``);
- ``POST /iop/v1/controls``: a change, ``{"kind", "target", "value", "reason"}``; an empty
  ``value`` clears (enable, ``--clear``);
- ``POST /iop/v1/controls/{change_id}/revert``: undo that change (``{"reason"}``).

Each is answered once the control-plane stored the change and pushed it to every edge;
the answer names the change (``change_id``) to revert it by. Who changed it is the key's
name and id, as the edge authenticated it: the caller cannot say otherwise.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from aiohttp import web

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.entrypoints.inference_request import parse_json_object
from iop_edge.errors import InvalidRequest, OperatorOnly
from iop_edge.ports import KeyRing

CONTROLS_PATH: Final = "/iop/v1/controls"
AUDIT_MAX: Final = 10_000
_FIELD_MAX: Final = 1_000


class ControlDesk(Protocol):
    """Where runtime controls are listed and changed (``adapters.control_desk``)."""

    async def listing(self, changed_by: str, audit_limit: int) -> dict[str, Any]: ...

    async def change(
        self, changed_by: str, kind: str, target: str, value: str, reason: str
    ) -> dict[str, Any]: ...

    async def revert(self, changed_by: str, change_id: str, reason: str) -> dict[str, Any]: ...


def operator_name(key: ApiKeyEntry | None) -> str:
    """Who the audit trail names: the key's name and id (the open API of a loopback-only
    edge without keys: "open API")."""
    return "open API" if key is None else f"{key.name} ({key.key_id})"


class ControlRoutes:
    def __init__(self, desk: ControlDesk, keys: KeyRing) -> None:
        self._desk = desk
        self._keys = keys

    def register(self, app: web.Application) -> None:
        app.router.add_get(CONTROLS_PATH, self.listing)
        app.router.add_post(CONTROLS_PATH, self.change)
        app.router.add_post(CONTROLS_PATH + "/{change_id}/revert", self.revert)

    def _operator(self, request: web.Request) -> str:
        key = authenticate(request, self._keys)
        if key is not None and not key.operator:
            raise OperatorOnly("Runtime control is for operator keys only.")
        return operator_name(key)

    async def listing(self, request: web.Request) -> web.Response:
        who = self._operator(request)
        raw = request.query.get("audit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= AUDIT_MAX:
            message = f"'audit' must be an integer from 1 to {AUDIT_MAX}."
            raise InvalidRequest(message, param="audit")
        return web.json_response(await self._desk.listing(who, int(raw)))

    async def change(self, request: web.Request) -> web.Response:
        who = self._operator(request)
        body = await _body(request)
        kind, target, value, reason = (
            _text(body, name) for name in ("kind", "target", "value", "reason")
        )
        if not kind or not target:
            raise InvalidRequest("'kind' and 'target' are required.", param="kind")
        return web.json_response(await self._desk.change(who, kind, target, value, reason))

    async def revert(self, request: web.Request) -> web.Response:
        who = self._operator(request)
        body = await _body(request) if request.can_read_body else {}
        change_id = request.match_info["change_id"]
        return web.json_response(await self._desk.revert(who, change_id, _text(body, "reason")))


async def _body(request: web.Request) -> dict[str, Any]:
    # the inference routes' one parse: no NaN, bounded nesting (a deep one was a 500)
    return await parse_json_object(await request.read())


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if isinstance(value, int) and not isinstance(value, bool) and name == "value":
        value = str(value)
    if not isinstance(value, str) or len(value) > _FIELD_MAX:
        raise InvalidRequest(f"'{name}' must be a string of at most {_FIELD_MAX}.", param=name)
    return value
