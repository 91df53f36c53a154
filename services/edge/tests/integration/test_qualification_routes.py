"""The qualification reports' admin API over real TCP behind the API's own gate, on both
stores (a real SQLite file, a real PostgreSQL): operators only, a report stored and read
back whole, listed newest first (by model), the catalog's newest per provider, a
malformed report refused, an unknown id a 404, and the SQLite file surviving a reopen."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import SecretStr

from iop_edge.adapters.pg_qualifications import PostgresQualifications
from iop_edge.adapters.sqlite_qualifications import SqliteQualifications
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_gate import ApiGate
from iop_edge.entrypoints.qualification_routes import QualificationRoutes
from iop_edge.qualification_ports import QualificationStore
from iop_edge.service.qualifications import QualificationBook
from iop_proto.postgres import PostgresSettings, open_pool

OPS = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)
ALICE = ApiKeyEntry("key_a", "alice", "hash-a", frozenset(), 0)


class Keys:
    configured = True  # a fleet config has arrived
    open = False

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return {"op": OPS, "alice": ALICE}.get(presented_key)


def report(model: str, provider: str, ttft: float) -> dict[str, Any]:
    return {
        "kind": "iop.qualification/v1",
        "model": model,
        "provider_id": provider,
        "node_id": "node-a",
        "engine": {"name": "llamacpp", "version": "b1234", "device": "cpu"},
        "performance": [{"concurrency": 1, "ttft_p50_ms": ttft}],
        "summary": {"ttft_p50_ms": ttft, "tool_call": "fail"},
    }


@contextlib.asynccontextmanager
async def serve(store: QualificationStore) -> AsyncIterator[str]:
    keys = Keys()
    app = web.Application(middlewares=[ApiGate(keys).middleware()])
    QualificationRoutes(QualificationBook(store), keys).register(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def call(
    method: str, url: str, key: str = "op", document: object = None, **params: str
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.request(
            method, url, headers=headers, json=document, params=params
        ) as response:
            return response.status, await response.json()


async def exercise(base: str) -> None:
    path = f"{base}/iop/v1/qualifications"
    status, first = await call("POST", path, document=report("m1", "p1", 120.0))
    assert status == 201, first
    assert first["id"].startswith("qual_")
    assert first["summary"] == {"ttft_p50_ms": 120.0, "tool_call": "fail"}
    assert first["engine"]["version"] == "b1234"
    _, second = await call("POST", path, document=report("m1", "p1", 90.0))
    _, other = await call("POST", path, document=report("m1", "p2", 300.0))
    _, elsewhere = await call("POST", path, document=report("m2", "p9", 10.0))

    status, whole = await call("GET", f"{path}/{first['id']}")
    assert status == 200
    assert whole == {
        **report("m1", "p1", 120.0),
        "id": first["id"],
        "created_ms": first["created_ms"],
    }

    _, listed = await call("GET", path, model="m1")
    assert {row["id"] for row in listed["data"]} == {first["id"], second["id"], other["id"]}
    stamps = [row["created_ms"] for row in listed["data"]]
    assert stamps == sorted(stamps, reverse=True)
    _, everything = await call("GET", path)
    assert len(everything["data"]) == 4

    # the catalog: the newest report of each provider of the model
    _, latest = await call("GET", f"{base}/iop/v1/catalog/qualifications", model="m1")
    newest = {row["provider_id"]: row["id"] for row in latest["data"]}
    assert newest["p2"] == other["id"]
    assert newest["p1"] in (first["id"], second["id"])
    assert (
        newest["p1"]
        == max((first, second), key=lambda r: (r["created_ms"], r["id"] == second["id"]))["id"]
    )
    assert elsewhere["id"] not in newest.values()

    status, body = await call("GET", f"{path}/qual_nope")
    assert status == 404, body
    status, body = await call("POST", path, document={"model": "m1", "summary": {}})
    assert status == 400
    assert "provider_id" in body["error"]["message"]
    # a tenant's key is refused every route: a report tells of the whole fleet
    for method, url in (("GET", path), ("GET", f"{path}/{first['id']}"), ("POST", path)):
        status, body = await call(method, url, key="alice", document=report("m1", "p1", 1.0))
        assert status == 403, (method, url, body)
        assert body["error"]["code"] == "operator_only"


async def test_reports_on_sqlite_are_stored_listed_and_kept(tmp_path: Path) -> None:
    store = await SqliteQualifications.open(tmp_path / "qualifications.db")
    try:
        async with serve(store) as base:
            await exercise(base)
    finally:
        await store.aclose()
    reopened = await SqliteQualifications.open(tmp_path / "qualifications.db")
    try:
        assert len(await reopened.recent()) == 4
        assert len(await reopened.recent("m2")) == 1
    finally:
        await reopened.aclose()


async def test_reports_on_postgresql_are_shared(postgres_dsn: str) -> None:
    settings = PostgresSettings(dsn=SecretStr(postgres_dsn), connect_timeout_s=5)
    pool = await open_pool(settings)
    try:
        async with serve(await PostgresQualifications.open(pool)) as base:
            await exercise(base)
        # another edge's store over the same database lists them (and migrates nothing)
        other_pool = await open_pool(settings)
        try:
            other = await PostgresQualifications.open(other_pool)
            assert len(await other.recent("m1")) == 3
        finally:
            await other_pool.close()
    finally:
        await pool.close()
