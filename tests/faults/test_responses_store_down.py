"""Stored responses on PostgreSQL through a real edge, with the server stopped under it:
a ``store: true`` request answers a retryable 503, ``store: false`` and chat completions
are still served, and what was stored before is there again once the server is back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from iop_edge.adapters.postgres_responses import PostgresResponseStore
from iop_proto.testing_postgres import PostgresServer

MODEL = "pg-mock"


async def respond(
    http: aiohttp.ClientSession, api_url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
    async with http.post(f"{api_url}/responses", json={"model": MODEL, **body}) as reply:
        return reply.status, await reply.json(), reply.headers


async def streamed_events(
    http: aiohttp.ClientSession, api_url: str, body: dict[str, Any]
) -> tuple[str, str]:
    """A streamed request's last two events' types: (``error``'s code when there is one)."""
    events: list[dict[str, Any]] = []
    body = {"model": MODEL, "stream": True, **body}
    async with http.post(f"{api_url}/responses", json=body) as reply:
        assert reply.status == 200
        async for raw in reply.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    assert not any(e["type"] == "response.completed" for e in events), events
    error = next((e for e in events if e["type"] == "error"), None)
    assert events[-1]["type"] == "response.failed"
    return ("error", str(error.get("code"))) if error is not None else ("none", "")


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
                assert await streamed_events(http, url, {"input": "two"}) == (
                    "error",
                    "storage_unavailable",  # the events do not say it was stored: they say why
                )
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
