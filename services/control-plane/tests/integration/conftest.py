"""A real credential store in a temporary SQLite file, for the command tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteCredentialStore]:
    opened = await SqliteCredentialStore.open(tmp_path / "credentials.db")
    try:
        yield opened
    finally:
        await opened.aclose()
