"""Read-only views on the control-plane's admin port (never a secret)."""

from __future__ import annotations

from aiohttp import web

from iop_control_plane.adapters.fleet_proto import fleet_view
from iop_control_plane.authority import FleetAuthority


def add_fleet_routes(app: web.Application, authority: FleetAuthority) -> None:
    """``GET /v1/fleet``: nodes, providers and models of the configuration being served."""

    async def fleet(request: web.Request) -> web.Response:
        snapshot = authority.snapshot
        return web.json_response(
            {
                "version": snapshot.version,
                **fleet_view(authority.fleet),
                "api_keys": len(snapshot.api_keys),
                "revoked_tokens": len(snapshot.revoked_token_ids),
            }
        )

    app.router.add_get("/v1/fleet", fleet)
