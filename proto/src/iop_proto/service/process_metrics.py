"""Process gauges every service exposes: file descriptors, sockets and asyncio tasks.

They are how a leak shows: a client that disconnects, a node that drops or a
run that is cancelled must give back its socket and its tasks. Fault tests
compare these gauges before and after a storm; operators graph them. Every
value is computed when ``/metrics`` is scraped, so nothing runs in between.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

_FD_DIR = Path("/proc/self/fd")


def register_process_metrics(registry: CollectorRegistry, loop: asyncio.AbstractEventLoop) -> None:
    """Add the process gauges to a service's own registry.

    ``ProcessCollector`` gives ``process_open_fds``, memory and CPU time (on
    Linux; elsewhere it yields nothing). ``iop_asyncio_tasks`` counts the tasks
    of ``loop``, the service's loop, captured here because a scrape may one day
    run elsewhere; ``iop_open_sockets`` is the sockets among the open fds.
    """
    ProcessCollector(registry=registry)
    Gauge(
        "iop_asyncio_tasks",
        "Tasks alive in the service's event loop (counted at scrape time)",
        registry=registry,
    ).set_function(lambda: len(asyncio.all_tasks(loop)))
    Gauge(
        "iop_open_sockets",
        "Open socket file descriptors of the process (Linux; NaN elsewhere)",
        registry=registry,
    ).set_function(count_open_sockets)


def count_open_sockets() -> float:
    """The process's fds that are sockets; NaN where ``/proc`` is not there."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return float("nan")
    sockets = 0
    for name in names:
        try:
            target = os.readlink(_FD_DIR / name)
        except OSError:
            continue  # closed between the listing and the look (or the listing's own fd)
        if target.startswith("socket:"):
            sockets += 1
    return float(sockets)
