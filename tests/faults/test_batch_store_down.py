"""The edge's files and batches on PostgreSQL, and the server stopped under it: the storage
APIs answer a retryable 503, inference keeps answering, the worker's calls fail without
its connection, and after the server is back the batch running through the outage runs
to its end with each line once.

A real stack (control-plane, edge, two nodes with mock providers, a worker) as
processes; the edge's ``postgres`` section points at the test's throwaway
PostgreSQL server, which the test stops and starts.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from iop_proto.testing_postgres import PostgresServer

CHAT = "/v1/chat/completions"


LINES = 8


def jsonl(count: int) -> bytes:
    """Lines that take a while each (the mock's delay), so the batch runs through the outage."""
    body = {
        "model": "pool",
        "messages": [{"role": "user", "content": "hi"}],
        "iop_mock": {"delay_ms": 1500},
    }
    lines = [
        {"custom_id": f"r{n}", "method": "POST", "url": CHAT, "body": body} for n in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def test_storage_answers_503_while_postgres_is_down_and_inference_goes_on(
    tmp_path: Path, start_stack_factory: Any, faults: Any, postgres_server: PostgresServer
) -> None:
    dsn = postgres_server.create_database()
    fleet = faults.pool_fleet("pool", "mock")
    edge = {"postgres": {"dsn": dsn, "connect_timeout_s": 5, "command_timeout_s": 10}}
    async with start_stack_factory(tmp_path, fleet, edge) as stack:
        api = stack.api_url
        async with aiohttp.ClientSession() as http:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", jsonl(LINES), filename="in.jsonl")
            async with http.post(f"{api}/files", data=form) as reply:
                assert reply.status == 200, await reply.text()
                file_id = (await reply.json())["id"]
            body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            async with http.post(f"{api}/batches", json=body) as reply:
                assert reply.status == 200, await reply.text()
                batch_id = (await reply.json())["id"]
            stored = await asyncpg.connect(dsn)
            try:  # in the shared store, not in a file beside the edge
                assert (
                    await stored.fetchval(
                        "SELECT COUNT(*) FROM edge_batch_lines WHERE batch_id = $1", batch_id
                    )
                    == LINES
                )
            finally:
                await stored.close()

            async def running() -> bool:
                async with http.get(f"{api}/batches/{batch_id}") as reply:
                    return (await reply.json())["status"] == "in_progress"

            await faults.eventually(running, timeout_s=30)
            await asyncio.to_thread(postgres_server.down)
            try:
                async with http.get(f"{api}/files") as reply:
                    assert reply.status == 503
                    assert reply.headers["Retry-After"]
                    error = (await reply.json())["error"]
                    assert error["code"] == "storage_unavailable"
                    assert "PostgreSQL" not in error["message"]  # the cause is logged only
                chat = {"model": "pool", "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(3):
                    async with http.post(f"{api}/chat/completions", json=chat) as reply:
                        assert reply.status == 200, await reply.text()
                        answer = await reply.json()
                        assert answer["choices"][0]["message"]["content"]
                # The worker's lines end meanwhile: their results cannot be stored, and
                # the worker is told so (an error it retries after), still connected.
                async with asyncio.timeout(30):
                    await stack.services["edge"].wait_for_line("not answered")
            finally:
                await asyncio.to_thread(postgres_server.up)

            async def ended() -> bool:
                async with http.get(f"{api}/batches/{batch_id}") as reply:
                    return reply.status == 200 and (await reply.json())["status"] == "completed"

            await faults.eventually(ended, timeout_s=90)  # the worker carries on after it
            async with http.get(f"{api}/batches/{batch_id}") as reply:
                done = await reply.json()
            assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
            assert done["error_file_id"] is None
            async with http.get(f"{api}/files/{done['output_file_id']}/content") as reply:
                assert reply.status == 200
                ids = [json.loads(line)["custom_id"] for line in (await reply.text()).splitlines()]
            assert sorted(ids) == sorted(f"r{n}" for n in range(LINES))  # each line once
            unexpected = ("failed in the edge", "unhandled error")  # ``log_unexpected``'s
            log = stack.services["edge"].log
            assert not [line for line in log if any(text in line for text in unexpected)]
            async with http.get(f"{api}/files/{file_id}") as reply:
                assert reply.status == 200  # nothing committed before the outage was lost
