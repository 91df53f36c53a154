"""The control-plane's composition root: every object is made here and owned by one exit stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from loguru import logger
from prometheus_client import CollectorRegistry

from iop_control_plane.adapters.stores import open_store
from iop_control_plane.authority import FleetAuthority
from iop_control_plane.entrypoints.admin_routes import add_fleet_routes
from iop_control_plane.entrypoints.controls import ControlDesk
from iop_control_plane.entrypoints.edge_server import EdgeServer
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.errors import IopError
from iop_proto.postgres import StorageUnavailable
from iop_proto.service import AdminServer
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import server_context


class ControlPlane:
    """The running service as the runner sees it: SIGHUP calls ``reload()``."""

    def __init__(self, authority: FleetAuthority, edge_server: EdgeServer) -> None:
        self.authority = authority
        self.edge_server = edge_server

    async def reload(self) -> None:
        logger.info("reload requested")
        await self.authority.reload_fleet()
        await self.authority.refresh_credentials()


async def _watch_credentials(authority: FleetAuthority, interval_s: float) -> None:
    """Notice tokens and keys the CLI issued or revoked (another process, same database;
    on PostgreSQL, any host's CLI, and so every control-plane on it).

    While the shared store is down the served configuration stays as it was (edges
    keep it, and keep their links); the outage is logged once, and its end once.
    """
    outage: StorageUnavailable | None = None
    while True:
        await asyncio.sleep(interval_s)
        try:
            await authority.refresh_credentials()
        except StorageUnavailable as exc:
            if outage is None:
                logger.warning("{}; serving config version {} meanwhile", exc, authority.version)
            outage = exc
            continue
        except Exception:
            logger.exception("refreshing credentials failed; will retry")
            continue
        if outage is not None:
            logger.info("the credential store is reachable again")
            outage = None


def _write_pid_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")


def _remove_pid_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()


@contextlib.asynccontextmanager
async def build(
    settings: ControlPlaneSettings, registry: CollectorRegistry, admin: AdminServer
) -> AsyncIterator[ControlPlane]:
    """Start the control-plane; leaving the context stops it in reverse order."""
    metrics = ControlPlaneMetrics.create(registry)
    tls = server_context(settings.tls) if settings.tls.enabled else None
    async with contextlib.AsyncExitStack() as stack:
        try:
            store = await open_store(settings)
        except StorageUnavailable as exc:
            # One line, no traceback: nothing to debug, PostgreSQL must be reachable first.
            raise IopError(f"{exc}; the control-plane starts once its store answers") from None
        stack.push_async_callback(store.aclose)
        if settings.postgres is not None:
            logger.info(
                "credential store: PostgreSQL, shared with every control-plane on it "
                "(pool of at most {})",
                settings.postgres.max_connections,
            )

        authority = FleetAuthority(settings.fleet_file, store, metrics)
        await authority.start()

        edge_server = EdgeServer(settings, authority, metrics, tls, ControlDesk(authority, store))
        admin.report_port("edges", await edge_server.start())
        stack.push_async_callback(edge_server.aclose)

        watcher = asyncio.create_task(
            _watch_credentials(authority, settings.credentials_poll_s), name="credentials-watch"
        )
        stack.push_async_callback(cancel_and_wait, watcher)

        pid_file = settings.resolved_pid_file
        _write_pid_file(pid_file)
        stack.callback(_remove_pid_file, pid_file)

        add_fleet_routes(admin.app, authority)
        yield ControlPlane(authority, edge_server)
