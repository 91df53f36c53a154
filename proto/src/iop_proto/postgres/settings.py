"""Where a service's shared store lives, and the bounds of its connection pool."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class PostgresSettings(BaseModel):
    """``postgres:`` in a service's config; absent, the service keeps SQLite files.

    ``dsn`` is a libpq URL (``postgresql://user:password@host:5432/iop``); it is a
    secret because it may carry a password, and never appears in a log.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dsn: SecretStr
    # Bounded both ways: a burst waits for a connection instead of opening one per
    # request, and an idle service keeps one warm.
    min_connections: int = Field(default=1, ge=0)
    max_connections: int = Field(default=10, ge=1)
    # How long one attempt to reach the server may take; a request that needs storage
    # while it is down gets a retryable 503 after this, not a hang.
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # The most one statement may run; storage calls are short by design.
    command_timeout_s: float = Field(default=30.0, gt=0)
