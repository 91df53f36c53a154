"""The worker's composition root: every object is made here and owned by one exit stack."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from loguru import logger
from prometheus_client import CollectorRegistry

from iop_proto.errors import ConfigurationError
from iop_proto.service import AdminServer
from iop_proto.tls import client_context
from iop_worker import __version__
from iop_worker.batch_runner import BatchRunner
from iop_worker.entrypoints.edge_link import EdgeLink
from iop_worker.metrics import WorkerMetrics
from iop_worker.settings import WorkerSettings


async def _stop(link: EdgeLink, task: asyncio.Task[None], grace_s: float) -> None:
    """Let lines in flight end (up to ``grace_s``), then cancel what is left and log failures."""
    link.stop()
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        logger.warning(
            "the edge link did not stop within {:.1f}s; cancelling it "
            "(lines still in flight are left to the lease expiry)",
            grace_s,
        )
        task.cancel()
    [outcome] = await asyncio.gather(task, return_exceptions=True)
    # A configuration error is the runner's to report (one line, exit code 2).
    if isinstance(outcome, Exception) and not isinstance(outcome, ConfigurationError):
        logger.opt(exception=outcome).error("the edge link failed")


@contextlib.asynccontextmanager
async def build(
    settings: WorkerSettings, registry: CollectorRegistry, admin: AdminServer
) -> AsyncIterator[EdgeLink]:
    """Start the worker; leaving the context stops it in reverse order."""
    # Load the certificates now so a broken file fails the start, not the first connection.
    tls = client_context(settings.tls) if settings.tls.enabled else None
    metrics = WorkerMetrics.create(registry)
    runner = BatchRunner(
        metrics,
        concurrency=settings.concurrency,
        poll_interval_s=settings.poll_interval_s,
        renew_interval_s=settings.lease_renew_interval_s,
    )
    link = EdgeLink(settings, runner, tls, metrics, __version__)
    async with contextlib.AsyncExitStack() as stack:
        task = asyncio.create_task(link.run(), name="edge-link")
        admin.fail_on_configuration_error(task)  # e.g. the edge's certificate does not fit
        stack.push_async_callback(_stop, link, task, settings.drain_s)
        admin.set_readiness(
            lambda: None if link.registered.is_set() else "not registered with the edge"
        )
        yield link
