"""The worker's composition root: every object is made here and owned by one exit stack."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from loguru import logger
from prometheus_client import CollectorRegistry

from iop_proto.dialer import DialSettings, LinkGauge
from iop_proto.edges import EdgeLinks
from iop_proto.errors import ConfigurationError
from iop_proto.service import AdminServer
from iop_proto.tls import client_context
from iop_worker import __version__
from iop_worker.batch_runner import BatchRunner
from iop_worker.entrypoints.edge_link import EdgeLink
from iop_worker.metrics import WorkerMetrics
from iop_worker.settings import WorkerSettings


async def _stop(
    links: EdgeLinks[EdgeLink], runner: BatchRunner, task: asyncio.Task[None], grace_s: float
) -> None:
    """Let lines in flight end (up to ``grace_s``), then cancel what is left and log failures."""
    runner.stop()  # no new lines or leases: each link's lines in flight end, then it closes
    links.stop()
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
) -> AsyncIterator[EdgeLinks[EdgeLink]]:
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

    def make_link(dial: DialSettings, gauge: LinkGauge) -> EdgeLink:
        return EdgeLink(dial, settings, runner, tls, gauge, __version__)

    # the answer timeout bounds the dial and the registration's answer too
    seeds = [DialSettings.of(settings, settings.answer_timeout_s, edge=e) for e in settings.seeds]
    links = EdgeLinks(seeds, make_link, metrics.edge_connected, follow=settings.follow_edges)
    async with contextlib.AsyncExitStack() as stack:
        task = asyncio.create_task(links.run(), name="edge-links")
        admin.fail_on_configuration_error(task)  # e.g. the edge's certificate does not fit
        stack.push_async_callback(_stop, links, runner, task, settings.drain_s)
        admin.set_readiness(
            lambda: None if links.registered.is_set() else "not registered with the edge"
        )
        yield links
