"""Stored responses on PostgreSQL through real edges, with the server stopped under one:
a ``store: true`` request answers a retryable 503, ``store: false`` and chat completions
are still served, and what was stored before is there again once the server is back; and
a response stored through one edge is read, continued and deleted through another."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml

from iop_edge.adapters.postgres_responses import PostgresResponseStore
from iop_proto.testing import running_service
from iop_proto.testing_postgres import PostgresServer

MODEL = "pg-mock"


async def respond(
    http: aiohttp.ClientSession, api_url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
    async with http.post(f"{api_url}/responses", json={"model": MODEL, **body}) as reply:
        return reply.status, await reply.json(), reply.headers


async def test_with_the_store_down_store_true_is_a_retryable_503_and_the_rest_serves(
    tmp_path: Path,
    start_stack_factory: Any,
    faults: Any,
    postgres_server: PostgresServer,
    postgres_dsn: str,
    report: Any,
) -> None:
    fleet = faults.pool_fleet(MODEL, "pg")
    edge = {"postgres": {"dsn": postgres_dsn, "connect_timeout_s": 2}}
    async with start_stack_factory(tmp_path, fleet, edge) as stack:
        url = stack.api_url
        async with aiohttp.ClientSession() as http:
            status, first, _ = await respond(http, url, {"input": "one"})
            assert status == 200, first
            kept = first["id"]

            # Stored in the shared table: another edge's store finds it for the same key
            # (the open API's, "") and for no other.
            pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=2)
            assert pool is not None
            other_edge = await PostgresResponseStore.open(pool)
            try:
                chain = await other_edge.chain(kept, "")
                assert chain is not None
                assert [t.response_id for t in chain] == [kept]
                assert await other_edge.get(kept, "key_b") is None
            finally:
                await other_edge.aclose()
                await pool.close()

            await asyncio.to_thread(postgres_server.down)
            try:
                status, refused, headers = await respond(http, url, {"input": "two"})
                assert status == 503, refused
                assert refused["error"]["code"] == "storage_unavailable"
                assert int(headers["Retry-After"]) > 0  # retryable
                # Known down now: refused before it runs, streamed or not (a stream whose
                # answer cannot be kept ends with an error event: test_responses_pipeline).
                streamed = {"input": "two", "stream": True}
                status, refused, headers = await respond(http, url, streamed)
                assert status == 503, refused
                assert refused["error"]["code"] == "storage_unavailable"
                status, unstored, _ = await respond(http, url, {"input": "x", "store": False})
                assert status == 200, unstored
                assert unstored["status"] == "completed"
                async with http.post(
                    f"{url}/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                ) as reply:
                    assert reply.status == 200  # inference does not depend on the store
                async with http.get(f"{url}/responses/{kept}") as reply:
                    assert reply.status == 503
                    assert (await reply.json())["error"]["code"] == "storage_unavailable"
            finally:
                await asyncio.to_thread(postgres_server.up)

            # Back: what was stored before is there, and continues.
            async with http.get(f"{url}/responses/{kept}") as reply:
                assert reply.status == 200
                assert (await reply.json())["id"] == kept
            status, second, _ = await respond(
                http, url, {"input": "three", "previous_response_id": kept}
            )
            assert status == 200, second
            async with http.get(f"{url}/responses/{second['id']}/input_items") as reply:
                assert reply.status == 200
                items = (await reply.json())["data"]
            said = json.dumps(items)
            assert "one" in said  # the first turn's input, read from the chain
            assert "three" in said
    report(f"stored {kept}; refused store:true with 503 while down; continued after")


async def test_a_response_stored_through_one_edge_continues_on_another(
    tmp_path: Path, start_stack_factory: Any, faults: Any, postgres_dsn: str
) -> None:
    fleet = faults.pool_fleet(MODEL, "pg")
    async with start_stack_factory(tmp_path, fleet, {"postgres": {"dsn": postgres_dsn}}) as stack:
        key_a = {"Authorization": f"Bearer {await stack.issue_key('a')}"}
        key_b = {"Authorization": f"Bearer {await stack.issue_key('b')}"}
        # A second edge process on the same database (its own ports and files, the same
        # identity): it reaches the control-plane and the store, no node dials it.
        settings = yaml.safe_load((tmp_path / "edge.yaml").read_text())
        for section in ("http", "node_listener", "admin"):
            settings[section]["port"] = 0
        for name in ("config_cache", "history_db", "responses_db", "batch_db"):
            settings[name] = str(tmp_path / f"edge-b-{Path(settings[name]).name}")
        (tmp_path / "edge-b.yaml").write_text(yaml.safe_dump(settings))
        async with (
            running_service("iop-edge", tmp_path / "edge-b.yaml") as edge_b,
            aiohttp.ClientSession() as http,
        ):
            url_a, url_b = stack.api_url, f"http://127.0.0.1:{edge_b.ports['http']}/v1"
            body = {"model": MODEL, "input": "one"}
            async with http.post(f"{url_a}/responses", json=body, headers=key_a) as reply:
                assert reply.status == 200
                kept = await reply.json()

            async def served_by_b() -> bool:  # once edge B has the keys from the control-plane
                async with http.get(f"{url_b}/responses/{kept['id']}", headers=key_a) as reply:
                    return reply.status == 200 and (await reply.json()) == kept

            await faults.eventually(served_by_b, timeout_s=30)
            async with http.get(f"{url_b}/responses/{kept['id']}", headers=key_b) as reply:
                assert reply.status == 404  # another key's: on no edge

            # node-b moves to edge B, which can then run a turn: it continues A's.
            await stack.stop("node-b")
            node_b = yaml.safe_load((tmp_path / "node-b.yaml").read_text())
            node_b["edge"]["port"] = edge_b.ports["nodes"]
            (tmp_path / "node-b.yaml").write_text(yaml.safe_dump(node_b))
            await stack.start("node-b")
            catalog = url_b.replace("/v1", "/iop/v1/catalog/providers")

            async def b_has_a_provider() -> bool:
                async with http.get(catalog, headers=key_a) as reply:
                    rows = (await reply.json())["data"] if reply.status == 200 else []
                return any(row["connected"] for row in rows)

            await faults.eventually(b_has_a_provider, timeout_s=30)
            body = {"model": MODEL, "input": "three", "previous_response_id": kept["id"]}
            async with http.post(f"{url_b}/responses", json=body, headers=key_a) as reply:
                assert reply.status == 200
                second = await reply.json()
            async with http.post(f"{url_b}/responses", json=body, headers=key_b) as reply:
                assert reply.status == 404  # another key cannot continue it on either edge
            items = f"{url_a}/responses/{second['id']}/input_items"
            async with http.get(items, headers=key_a) as reply:
                assert reply.status == 200
                said = json.dumps((await reply.json())["data"])
            assert "one" in said  # the turn made on A, read back on A through B's turn
            assert "three" in said
            async with http.delete(f"{url_b}/responses/{kept['id']}", headers=key_a) as reply:
                assert reply.status == 200
            async with http.get(f"{url_a}/responses/{kept['id']}", headers=key_a) as reply:
                assert reply.status == 404  # deleted through B: gone on A too
