"""Run one service from ``--config FILE`` until SIGTERM or SIGINT, then stop gracefully.

Signals are handled only here, by setting an event; the service's own objects
never see them. Teardown is the reverse of start-up (``AsyncExitStack``) and is
bounded by the service's ``shutdown_timeout_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from loguru import logger
from prometheus_client import CollectorRegistry, Info

from iop_proto.errors import ConfigurationError, IopError, SettingsError
from iop_proto.service.admin import AdminServer
from iop_proto.service.cert_metrics import register_certificate_metrics
from iop_proto.service.logging import configure_logging
from iop_proto.service.process_metrics import register_process_metrics
from iop_proto.service.settings import ServiceSettings, load_settings

SettingsT = TypeVar("SettingsT", bound=ServiceSettings)

ServiceFactory = Callable[
    [SettingsT, CollectorRegistry, AdminServer], contextlib.AbstractAsyncContextManager[object]
]
"""``bootstrap.build``: makes every object of a service and owns their lifetimes.

Entering the context starts the service; leaving it stops it. The admin server
is passed in so a service can add its own routes or readiness check.
"""


@runtime_checkable
class Reloadable(Protocol):
    """A service that re-reads its configuration on SIGHUP (without restarting)."""

    async def reload(self) -> None: ...


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_SETTINGS = 2


def parse_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=f"Run the IOP {prog} service.")
    parser.add_argument("--config", type=Path, required=True, help="settings YAML file")
    return parser.parse_args(argv)


async def serve(
    name: str,
    version: str,
    settings: SettingsT,
    build: ServiceFactory[SettingsT],
    stop: asyncio.Event,
    reload: asyncio.Event | None = None,
) -> None:
    """Start the service and its admin port, wait for ``stop``, then tear down.

    ``reload`` (set on SIGHUP) calls ``service.reload()`` when the object the
    service's context yields is ``Reloadable``; a failed reload is logged and the
    service keeps running with what it had.
    """
    registry = CollectorRegistry()
    # Open fds and sockets, live tasks: where a leak (a disconnect not cleaned up) shows.
    register_process_metrics(registry, asyncio.get_running_loop())
    # When its own certificate and its CAs expire, for the certificate alerts.
    register_certificate_metrics(registry, name, settings.tls)
    Info("iop_build", "Version of this IOP service", registry=registry).info(
        {"service": name, "version": version, "service_id": settings.service_id}
    )
    if not settings.tls.enabled:
        logger.warning("tls.enabled is false: IOP traffic is plaintext, for debugging only")
    admin = AdminServer(
        name,
        registry,
        host=settings.admin.host,
        port=settings.admin.port,
        idle_timeout_s=settings.admin.idle_timeout_s,
        max_connections=settings.admin.max_connections,
    )
    async with contextlib.AsyncExitStack() as stack:
        service = await stack.enter_async_context(build(settings, registry, admin))
        port = await admin.start()
        stack.push_async_callback(admin.close)
        # The line tests wait for: the admin URL and the bound listening ports (JSON), so
        # every port may be configured as 0 (also in /readyz).
        logger.info(
            "ready: {} admin http://{}:{} ports {}",
            settings.service_id,
            settings.admin.host,
            port,
            json.dumps(admin.ports, separators=(",", ":")),
        )
        await _wait_for_stop(stop, reload or asyncio.Event(), service, admin.failed)
        logger.info("stopping {} (up to {:.0f}s)", settings.service_id, settings.shutdown_timeout_s)
        async with asyncio.timeout(settings.shutdown_timeout_s):
            await stack.aclose()
    logger.info("stopped {}", settings.service_id)
    if admin.failure is not None:
        raise admin.failure


async def _wait_for_stop(
    stop: asyncio.Event, reload: asyncio.Event, service: object, failed: asyncio.Event
) -> None:
    while not stop.is_set() and not failed.is_set():
        waiters = {
            asyncio.create_task(stop.wait()),
            asyncio.create_task(reload.wait()),
            asyncio.create_task(failed.wait()),
        }
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        if reload.is_set() and not stop.is_set():
            reload.clear()
            if not isinstance(service, Reloadable):
                logger.info("SIGHUP ignored: this service has nothing to reload")
                continue
            try:
                await service.reload()
            except Exception:
                logger.exception("reload failed; keeping the running configuration")


async def _main(
    name: str, version: str, settings: SettingsT, build: ServiceFactory[SettingsT]
) -> None:
    stop = asyncio.Event()
    reload = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload.set)
    await serve(name, version, settings, build, stop, reload)


def run_service(
    name: str,
    version: str,
    settings_model: type[SettingsT],
    build: ServiceFactory[SettingsT],
    argv: list[str] | None = None,
) -> int:
    """The whole life of a service process; returns its exit code."""
    args = parse_args(f"iop-{name}", argv)
    try:
        settings = load_settings(settings_model, args.config)
    except SettingsError as exc:
        print(f"iop-{name}: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    configure_logging(settings.service_id, settings.log)
    try:
        _event_loop_runner(settings.event_loop)(_main(name, version, settings, build))
    except ConfigurationError as exc:
        # One line that says what to fix; no traceback: nothing here is a bug.
        logger.error("{} stopped: configuration error: {}", settings.service_id, exc)
        return EXIT_BAD_SETTINGS
    except IopError as exc:
        logger.error("{} failed: {}", settings.service_id, exc)
        return EXIT_FAILED
    except Exception:
        logger.exception("{} crashed", settings.service_id)
        return EXIT_FAILED
    return EXIT_OK


def _event_loop_runner(choice: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop by default: its transports and TLS are a large share of every request's CPU.

    Falls back to asyncio's loop where uvloop is not installed (Windows has none).
    """
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            logger.info("uvloop is not installed: running on asyncio's own event loop")
        else:
            return uvloop.run
    return asyncio.run
