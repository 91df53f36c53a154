"""The iop-postgres image as the edges' shared store: the edge's storage contract run on it.

testcontainers starts the image `make images` built (Debian's PostgreSQL 15 on the project's
base, no registry) on a network of its own, published on the loopback only. The contract
tests that the edge runs on both backends (services/edge/tests/integration: the stored
responses, and files and batches) then run here as written, each on a fresh database of that
container instead of the throwaway cluster of `iop_proto.testing_postgres`: a test is taken
when it needs nothing but a backend (`backend`, `postgres`, `batch_backend`, `store`), so the
one-backend tests (SQLite files, a server stopped under a store) stay where they are.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncpg
import pytest
from pydantic import SecretStr

from iop_proto.postgres import PostgresSettings, open_pool

ROOT = Path(__file__).resolve().parents[2]
EDGE_TESTS = ROOT / "services" / "edge" / "tests"
CONTRACTS = {
    "responses": EDGE_TESTS / "integration" / "test_response_store.py",
    "batches": EDGE_TESTS / "integration" / "test_batch_store.py",
}
BACKEND_FIXTURES = {"backend", "postgres", "batch_backend", "store"}
IMAGE = "iop-postgres:latest"
READY_WITHIN_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def load(path: Path) -> ModuleType:
    """A test module of the edge, imported under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"iop_contract_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULES = {name: load(path) for name, path in CONTRACTS.items()}
EDGE_CONFTEST = load(EDGE_TESTS / "conftest.py")  # BatchBackend (a conftest cannot be imported)


def contract_cases() -> list[tuple[str, str]]:
    """(contract, test name) of every test that needs nothing but a backend."""
    cases = []
    for contract, module in MODULES.items():
        for name, function in vars(module).items():
            if name.startswith("test_") and inspect.iscoroutinefunction(function):
                wanted = set(inspect.signature(function).parameters)
                if wanted and wanted <= BACKEND_FIXTURES:
                    cases.append((contract, name))
    return cases


CASES = contract_cases()


def test_the_contract_has_tests_of_both_stores() -> None:
    """The selection above found the contracts (a rename there must not empty this file)."""
    counts = {contract: sum(1 for c, _ in CASES if c == contract) for contract in CONTRACTS}
    assert counts["responses"] >= 4, CASES
    assert counts["batches"] >= 4, CASES


async def ready(dsn: str) -> str:
    """The server's version once it takes a connection (its log says ready before the TCP
    listener of the published port does: poll the real signal, a connection)."""
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        try:
            connection = await asyncpg.connect(dsn, timeout=5)
        except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{IMAGE} took no connection: {exc!r}") from exc
            await asyncio.sleep(0.5)
            continue
        try:
            return str(await connection.fetchval("SHOW server_version"))
        finally:
            await connection.close()


@pytest.fixture(scope="module")
def image_postgres(docker: str) -> Iterator[str]:
    """iop-postgres started by testcontainers; the DSN of its `iop` database."""
    found = subprocess.run([docker, "image", "inspect", IMAGE], capture_output=True, timeout=60)
    if found.returncode != 0:
        pytest.fail(f"{IMAGE} is not built (`make images`)")
    from testcontainers.core.container import DockerContainer  # after the engine check
    from testcontainers.core.network import Network

    # A network of its own: the engine of `make test-containers` has no default bridge.
    with Network() as network:
        container = DockerContainer(IMAGE).with_network(network)
        # Published on the loopback only, on a port the engine picks.
        container.ports["5432"] = ("127.0.0.1",)  # type: ignore[assignment]
        with container:
            port = container.get_exposed_port(5432)
            dsn = f"postgresql://iop@127.0.0.1:{port}/iop"
            version = asyncio.run(ready(dsn))
            assert version.startswith("15."), version  # Debian bookworm's server
            yield dsn


@pytest.fixture
async def database(image_postgres: str) -> AsyncIterator[str]:
    """A fresh database in the container, for one contract test; dropped after."""
    name = f"t_{uuid.uuid4().hex[:12]}"  # an identifier: CREATE DATABASE takes no parameter
    admin = await asyncpg.connect(image_postgres)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        yield image_postgres.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest.mark.parametrize(("contract", "name"), CASES, ids=[f"{c}-{n}" for c, n in CASES])
async def test_the_edge_storage_contract_holds_on_the_image(
    database: str, contract: str, name: str, tmp_path: Path
) -> None:
    test = getattr(MODULES[contract], name)
    wanted = inspect.signature(test).parameters
    responses = MODULES["responses"].PostgresBackend(database)
    pool = await open_pool(PostgresSettings(dsn=SecretStr(database), max_connections=8))
    batches = EDGE_CONFTEST.BatchBackend("postgres", tmp_path / "batches.db", pool)
    store: Any = None
    try:
        fixtures: dict[str, Any] = {"backend": responses, "postgres": responses}
        fixtures["batch_backend"] = batches
        if "store" in wanted:
            store = await batches.open()
            fixtures["store"] = store
        await test(**{parameter: fixtures[parameter] for parameter in wanted})
    finally:
        if store is not None:
            await store.aclose()
        await responses.aclose()
        await pool.close()
