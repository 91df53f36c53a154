"""A lost or refusing PostgreSQL server, seen by callers as one retryable error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import asyncpg


class StorageUnavailable(Exception):
    """The shared store cannot be reached now; the caller may retry later.

    Storage APIs answer 503 with ``Retry-After`` for it; inference does not depend
    on the store and keeps serving.
    """


# What a server that is down, restarting or out of connections raises: the
# connection failed, was cut, or the server refused new work. A constraint
# violation or a bad query is a bug, not an outage, and passes through.
_OUTAGES: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.PostgresConnectionError,
)


@contextlib.contextmanager
def reachable(what: str) -> Iterator[None]:
    """Run a storage step; an outage inside it becomes ``StorageUnavailable(what)``."""
    try:
        yield
    except _OUTAGES as error:
        raise StorageUnavailable(
            f"{what}: the PostgreSQL store is unreachable ({error!r})"
        ) from error
