"""Fixtures for the contract tests."""

from __future__ import annotations

import pytest

from iop_proto.testing import Pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """One throwaway fleet CA for the session, with an edge and a node identity."""
    return Pki.create(tmp_path_factory.mktemp("pki"))
