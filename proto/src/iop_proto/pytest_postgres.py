"""Pytest fixtures for a real PostgreSQL (``-p iop_proto.pytest_postgres`` in addopts).

``postgres_server``: one cluster per test process, skipped with the reason where
the server cannot run here. ``postgres_dsn``: an empty database for one test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from iop_proto.testing_postgres import PostgresServer, running_postgres, why_postgres_cannot_run


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    reason = why_postgres_cannot_run()
    if reason is not None:
        # CI installs the server, so there a missing one is a failure, not a skip.
        if os.environ.get("TEST_POSTGRES_REQUIRED"):
            pytest.fail(reason)
        pytest.skip(reason)
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer) -> str:
    return postgres_server.create_database()
