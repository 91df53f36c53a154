"""Stopping background tasks the one way every service stops them.

``task.cancel()`` followed by ``await task`` inside ``suppress(CancelledError)``
looks right and is not: a cancellation of the *caller* (a second Ctrl-C, a
shutdown timeout) arrives as the same exception and is swallowed with the
task's. ``asyncio.wait`` tells the two apart: it never raises the task's
cancellation, only its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from loguru import logger

from iop_proto.errors import ConfigurationError


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has ended.

    A task that ended with an error other than its cancellation is logged with
    its traceback, not raised: one failed task must not keep the others (or the
    rest of a shutdown) from being stopped. A cancellation of the caller while it
    waits propagates as usual; the tasks have been cancelled all the same.
    """
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    log_failures(pending)


def log_failures(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Log each finished task that raised (cancelled ones and successes are quiet).

    A ``ConfigurationError`` is not a failure of the code: the runner reports it as the
    reason the service stopped (``AdminServer.fail``), in one line, without a traceback.
    """
    for task in tasks:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, ConfigurationError):
                continue
            logger.opt(exception=error).error("task {} failed", task.get_name())
