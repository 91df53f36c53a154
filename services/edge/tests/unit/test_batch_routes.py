"""``/v1/files`` and ``/v1/batches`` served for real on 127.0.0.1, driven by the OpenAI SDK.

The app is ``create_api_app(..., batches=...)`` over a real ``BatchService`` and
SQLite store; dispatch is a fake. The test plays the worker by calling
``lease`` / ``run_line`` / ``release`` on the service, then reads the results
back through the SDK as a client would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from iop_edge.adapters.batch_store import SqliteBatchStore
from iop_edge.adapters.run_wire import run_event
from iop_edge.domain.events import Failed, RunEvent
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.http_api import create_api_app, load_openapi
from iop_edge.errors import EdgeError, from_failure
from iop_edge.ports import AttemptRecord, EdgeRunRecord, RunSpec
from iop_edge.service.batches import BatchService
from iop_edge.testing import one_at_a_time
from iop_proto.v1 import runtime_pb2 as pb


async def as_events(wire: AsyncIterator[pb.RunEvent]) -> AsyncIterator[RunEvent]:
    """The fake's wire events as the node listener hands them on (converted once)."""
    async for message in wire:
        event = run_event(message)
        if event is not None:
            yield event


CHAT: Final = "/v1/chat/completions"
MODEL = "llama3.1:8b"
MAX_FILE = 4096


class FakeRun:
    """A provider that answers every chat request with the same result."""

    def __init__(self, spec: RunSpec, run_id: str) -> None:
        self.run_id, self.provider_id, self.node_id, self.target = run_id, "p1", "n1", "served"
        self.node_wait_ms = 0
        self.spec = spec

    _reading: AsyncIterator[RunEvent] | None = None

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        return (AttemptRecord(self.run_id, self.provider_id, self.node_id, "completed"),)

    async def next_events(self) -> tuple[RunEvent, ...]:
        if self._reading is None:
            self._reading = as_events(self._events())
        return await one_at_a_time(self._reading)

    async def _events(self) -> AsyncIterator[pb.RunEvent]:
        result = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "served",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
        }
        complete = pb.RunComplete(result_json=json.dumps(result).encode())
        yield pb.RunEvent(run_id=self.run_id, complete=complete)

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        pass

    async def open(self) -> None:
        """Dispatched at once: no queue."""

    ended = False

    def error(self, failed: Failed) -> EdgeError:
        return from_failure(failed)


class FakeRuns:
    def __init__(self) -> None:
        self.specs: list[RunSpec] = []

    def admit(self, spec: RunSpec) -> FakeRun:
        self.specs.append(spec)
        return FakeRun(spec, f"run-{len(self.specs)}")


class FakeCatalog:
    def __init__(self) -> None:
        self.entry = ModelEntry(MODEL, MODEL, {"p1": "served"})

    def models(self) -> list[ModelEntry]:
        return [self.entry]

    def model(self, model_id: str) -> ModelEntry | None:
        return self.entry if model_id == MODEL else None

    def provider_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        return []

    def model_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        return []

    def any_available(self) -> bool:
        return True


@dataclass
class FakeKeys:
    by_key: dict[str, ApiKeyEntry] | None

    configured = True  # a fleet config has arrived

    @property
    def open(self) -> bool:
        return self.by_key is None

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return (self.by_key or {}).get(presented_key)


class FakeRunLog:
    def record(self, record: EdgeRunRecord) -> None:
        pass

    async def recent(self, limit: int) -> list[EdgeRunRecord]:
        return []


@dataclass
class Edge:
    url: str
    service: BatchService
    runs: FakeRuns

    def sdk(self, api_key: str = "sk-any") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)


@contextlib.asynccontextmanager
async def serve(
    tmp_path: Path, keys: dict[str, ApiKeyEntry] | None = None, *, with_batches: bool = True
) -> AsyncIterator[Edge]:
    registry = CollectorRegistry()
    runs, catalog = FakeRuns(), FakeCatalog()
    store = await SqliteBatchStore.open(tmp_path / "batches.db")
    service = BatchService(store, runs, catalog, registry, max_file_bytes=MAX_FILE)
    app = create_api_app(
        runs,
        catalog,
        FakeKeys(keys),
        FakeRunLog(),
        ApiMetrics.create(registry),
        openapi=load_openapi(),
        batches=service if with_batches else None,
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield Edge(f"http://{host}:{port}", service, runs)
    finally:
        await runner.cleanup()
        await store.aclose()


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Edge]:
    async with serve(tmp_path) as served:
        yield served


def request(custom_id: str, model: str = MODEL) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def test_a_batch_from_upload_to_results(edge: Edge) -> None:
    content = jsonl(request("one"), request("two", model="no-such-model"), request("three"))
    async with edge.sdk() as client:
        file = await client.files.create(
            file=("requests.jsonl", content, "application/jsonl"), purpose="batch"
        )
        assert (file.object, file.purpose, file.bytes, file.filename) == (
            "file",
            "batch",
            len(content),
            "requests.jsonl",
        )
        assert (await client.files.retrieve(file.id)).id == file.id
        assert (await client.files.content(file.id)).content == content

        batch = await client.batches.create(
            input_file_id=file.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert (batch.status, batch.endpoint, batch.input_file_id) == ("validating", CHAT, file.id)
        assert batch.metadata == {"job": "nightly"}
        assert batch.request_counts is not None
        assert batch.request_counts.total == 3

        # The worker's side, on the service itself.
        grant = await edge.service.lease("worker-1")
        assert grant.batch_id == batch.id
        for n in range(grant.next_line, grant.total_lines):
            await edge.service.run_line(grant.lease_id, n)
        await edge.service.release(grant.lease_id, finished=True)

        done = await client.batches.retrieve(batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (3, 2, 1)
        assert done.output_file_id is not None
        assert done.error_file_id is not None
        output = (await client.files.content(done.output_file_id)).text.splitlines()
        errors = (await client.files.content(done.error_file_id)).text.splitlines()
        assert [json.loads(line)["custom_id"] for line in output] == ["one", "three"]
        assert json.loads(output[0])["response"]["body"]["model"] == MODEL
        (error,) = [json.loads(line) for line in errors]
        assert error["custom_id"] == "two"
        assert error["response"]["status_code"] == 404
        assert error["response"]["body"]["error"]["code"] == "model_not_found"
        output_file = await client.files.retrieve(done.output_file_id)
        assert output_file.purpose == "batch_output"

        deleted = await client.files.delete(file.id)
        assert (deleted.id, deleted.deleted) == (file.id, True)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.files.retrieve(file.id)
    assert caught.value.body == {
        "message": f"No such File object: {file.id}",
        "type": "invalid_request_error",
        "param": "id",
        "code": None,
    }
    assert [spec.batch for spec in edge.runs.specs] == [True, True]


async def test_list_and_cancel(edge: Edge) -> None:
    async with edge.sdk() as client:
        file = await client.files.create(
            file=("r.jsonl", jsonl(request("a")), "application/jsonl"), purpose="batch"
        )
        ids = [
            (
                await client.batches.create(
                    input_file_id=file.id, endpoint=CHAT, completion_window="24h"
                )
            ).id
            for _ in range(3)
        ]
        page = await client.batches.list(limit=2)
        assert [b.id for b in page.data] == ids[::-1][:2]
        assert page.has_more
        everything = [b.id async for b in client.batches.list(limit=2)]  # follows the cursor
        assert everything == ids[::-1]

        cancelled = await client.batches.cancel(ids[0])
        assert cancelled.status == "cancelled"  # no worker held it
        assert cancelled.cancelled_at is not None
        grant = await edge.service.lease("worker-1")
        assert grant.batch_id == ids[1]  # the oldest still runnable
        cancelling = await client.batches.cancel(ids[1])
        assert cancelling.status == "cancelling"
        await edge.service.release(grant.lease_id, finished=False)
        assert (await client.batches.retrieve(ids[1])).status == "cancelled"


async def test_client_errors_are_openai_errors(edge: Edge) -> None:
    async with edge.sdk() as client:
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")
        with pytest.raises(openai.NotFoundError):
            await client.batches.cancel("batch_nope")
        with pytest.raises(openai.NotFoundError):
            await client.files.content("file-nope")
        with pytest.raises(openai.NotFoundError):
            await client.files.delete("file-nope")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.batches.create(
                input_file_id="file-nope", endpoint=CHAT, completion_window="24h"
            )
        assert missing.value.body["param"] == "input_file_id"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as purpose:
            await client.files.create(file=("r.jsonl", b"{}\n"), purpose="fine-tune")
        assert purpose.value.body["param"] == "purpose"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as too_big:
            await client.files.create(file=("r.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
        assert too_big.value.body["param"] == "file"  # type: ignore[index]
        file = await client.files.create(file=("r.jsonl", jsonl(request("a"))), purpose="batch")
        for extra, param in (
            ({"endpoint": "/v1/responses"}, "endpoint"),
            ({"completion_window": "1h"}, "completion_window"),
        ):
            arguments: dict[str, Any] = {"endpoint": CHAT, "completion_window": "24h", **extra}
            with pytest.raises(openai.BadRequestError) as caught:
                await client.batches.create(input_file_id=file.id, **arguments)
            assert caught.value.body["param"] == param  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as limit:
            await client.batches.list(limit=1000)
        assert limit.value.body["param"] == "limit"  # type: ignore[index]


async def test_an_invalid_input_file_makes_a_failed_batch(edge: Edge) -> None:
    content = jsonl(request("a"), request("a")) + b"not json\n"
    async with edge.sdk() as client:
        file = await client.files.create(file=("r.jsonl", content), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint=CHAT, completion_window="24h"
        )
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2),
        ("invalid_json_line", 3),
    ]


async def test_malformed_uploads_are_400(edge: Edge) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{edge.url}/v1/files", json={"purpose": "batch"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "file"
        form = aiohttp.FormData()
        form.add_field("file", b"{}\n", filename="r.jsonl")
        async with http.post(f"{edge.url}/v1/files", data=form) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "purpose"
        async with http.post(f"{edge.url}/v1/batches", data=b"{nope") as response:
            assert response.status == 400


async def test_the_file_part_may_come_before_the_purpose_and_only_once(edge: Edge) -> None:
    """curl ``-F file=@x -F purpose=batch`` sends the file first: it is streamed to disk
    before the purpose is known, and stored (or dropped) once it is."""
    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData()
        form.add_field("file", jsonl(request("a")), filename="r.jsonl")
        form.add_field("purpose", "batch")
        async with http.post(f"{edge.url}/v1/files", data=form) as response:
            assert response.status == 200
            created = await response.json()
        assert created["bytes"] == len(jsonl(request("a")))
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"{}\n", filename="one.jsonl")
        form.add_field("file", b"{}\n", filename="two.jsonl")
        async with http.post(f"{edge.url}/v1/files", data=form) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "file"
    async with edge.sdk() as client:
        assert [f.id async for f in client.files.list()] == [created["id"]]


async def test_the_routes_need_a_key_when_keys_are_configured(tmp_path: Path) -> None:
    keys = {"sk-good": ApiKeyEntry("k1", "k1", "hash", frozenset(), 0)}
    async with serve(tmp_path, keys) as edge:
        async with edge.sdk("sk-wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.batches.list()
            with pytest.raises(openai.AuthenticationError):
                await client.files.create(file=("r.jsonl", b"{}\n"), purpose="batch")
        async with edge.sdk("sk-good") as client:
            assert (await client.batches.list()).data == []


async def test_each_key_sees_only_its_own_and_an_operator_sees_all(tmp_path: Path) -> None:
    keys = {
        "sk-a": ApiKeyEntry("key_a", "a", "hash-a", frozenset(), 0),
        "sk-b": ApiKeyEntry("key_b", "b", "hash-b", frozenset(), 0),
        "sk-op": ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True),
    }
    async with serve(tmp_path, keys) as edge:
        async with edge.sdk("sk-a") as a, edge.sdk("sk-b") as b, edge.sdk("sk-op") as op:
            file = await a.files.create(file=("r.jsonl", jsonl(request("x"))), purpose="batch")
            batch = await a.batches.create(
                input_file_id=file.id, endpoint=CHAT, completion_window="24h"
            )
            refused = [
                b.files.retrieve(file.id),
                b.files.content(file.id),
                b.files.delete(file.id),
                b.batches.retrieve(batch.id),
                b.batches.cancel(batch.id),
                b.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h"),
            ]
            for call in refused:
                with pytest.raises(openai.NotFoundError) as caught:
                    await call
                assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
            assert [f.id async for f in b.files.list()] == []
            assert [x.id async for x in b.batches.list()] == []
            assert [f.id async for f in a.files.list()] == [file.id]
            assert [f.id async for f in op.files.list()] == [file.id]
            assert [x.id async for x in op.batches.list()] == [batch.id]
            assert (await op.files.content(file.id)).content == jsonl(request("x"))
            assert (await op.batches.cancel(batch.id)).status == "cancelled"
            assert (await a.batches.retrieve(batch.id)).status == "cancelled"


async def test_the_file_list_takes_openai_parameters(edge: Edge) -> None:
    async with edge.sdk() as client:
        ids = [
            (await client.files.create(file=("r.jsonl", jsonl(request("a"))), purpose="batch")).id
            for _ in range(3)
        ]
        page = await client.files.list(limit=2)
        assert ([f.id for f in page.data], page.has_more) == (ids[::-1][:2], True)
        assert [f.id async for f in client.files.list(limit=2)] == ids[::-1]
        assert [f.id async for f in client.files.list(order="asc")] == ids
        assert [f.id async for f in client.files.list(purpose="batch_output")] == []
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.list(limit=0)
        assert caught.value.body["param"] == "limit"  # type: ignore[index]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{edge.url}/v1/files", params={"order": "sideways"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "order"


async def test_without_a_batch_service_the_routes_do_not_exist(tmp_path: Path) -> None:
    async with serve(tmp_path, with_batches=False) as edge:
        async with edge.sdk() as client:
            with pytest.raises(openai.NotFoundError) as caught:
                await client.batches.list()
    assert caught.value.body["code"] == "unknown_url"  # type: ignore[index]


async def test_every_batch_route_is_in_the_openapi_document(tmp_path: Path) -> None:
    documented = load_openapi()["paths"]
    async with serve(tmp_path) as edge:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{edge.url}/openapi.json") as response:
                assert (await response.json())["paths"] == documented
    expected = {
        ("/v1/files", "post"),
        ("/v1/files", "get"),
        ("/v1/files/{file_id}", "get"),
        ("/v1/files/{file_id}", "delete"),
        ("/v1/files/{file_id}/content", "get"),
        ("/v1/batches", "post"),
        ("/v1/batches", "get"),
        ("/v1/batches/{batch_id}", "get"),
        ("/v1/batches/{batch_id}/cancel", "post"),
    }
    assert {(path, method) for path, method in expected if method in documented[path]} == expected


async def test_the_file_list_pages_by_limit_after_and_order_and_filters_by_purpose(
    tmp_path: Path,
) -> None:
    """``GET /v1/files`` as OpenAI's reference has it: ``purpose``, ``limit``, ``after``,
    ``order`` (newest first by default), read through the SDK's pager."""
    async with serve(tmp_path) as edge, edge.sdk() as client:
        made = [
            (await client.files.create(file=(f"{n}.jsonl", jsonl(request(n))), purpose="batch")).id
            for n in ("a", "b", "c")
        ]
        newest_first = await client.files.list(limit=2)
        oldest_first = await client.files.list(limit=2, order="asc")
        after = await client.files.list(order="asc", after=made[0])
        everything = [f.id async for f in client.files.list(limit=1)]  # the pager follows after
        other_purpose = await client.files.list(purpose="assistants")
    assert [f.id for f in newest_first.data] == [made[2], made[1]]
    assert newest_first.has_more
    assert [f.id for f in oldest_first.data] == made[:2]
    assert [f.id for f in after.data] == made[1:]
    assert everything == made[::-1]
    assert other_purpose.data == []
