"""The coding agents' suite (``make test-agents``): ``make run``'s own stack, once for the
session, which every agent and client library is pointed at.

``make test`` leaves them out (pyproject.toml's testpaths); a plain ``pytest tests/agents``
runs them where ``make agents`` has installed the agents and skips them, naming
``make agents``, where it has not; ``make test-agents`` sets ``TEST_AGENTS_REQUIRED=1``,
which turns that absence into a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

REPO = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("TEST_AGENTS_REQUIRED") == "1"


def _local_stack_module() -> object:
    """``tests/e2e/test_local_stack.py``: how the e2e suite starts ``make run``'s stack."""
    path = REPO / "tests" / "e2e" / "test_local_stack.py"
    spec = importlib.util.spec_from_file_location("iop_agents_conftest_local_stack", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def origin(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """``make run``'s stack (llama.cpp with SmolLM2, the mocks) on shifted ports, up once for
    the session; yields the edge's origin (no ``/v1``)."""
    installed = (REPO / "var" / "agents").is_dir() or (REPO / "var" / "clients").is_dir()
    if not installed and not REQUIRED:
        pytest.skip("no coding agent or client library is installed (make agents)")
    local = _local_stack_module()
    why = local.missing_llamacpp()  # type: ignore[attr-defined]
    if why is not None and not REQUIRED:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("agents-stack")
    certs = root / "certs"
    made = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "tools" / "devcerts.py"), "--out", str(certs)
    )
    assert await made.wait() == 0
    async with local.local_stack(root, certs) as (_, up):  # type: ignore[attr-defined]
        yield up["api"].removesuffix("/v1")
