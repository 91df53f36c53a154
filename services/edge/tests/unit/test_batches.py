"""``BatchService`` over a real store, with a fake ``RunService`` and a fake clock.

Every test that takes ``h`` runs on both backends (``batch_backend``: a SQLite
file and a real PostgreSQL database): the store's contract, checked through the
service that depends on it.

The fake dispatch answers by model: ``good`` completes, ``broken`` fails at the
provider, ``busy`` finds no room (transient), ``slow`` waits for the test.
Every test states what the worker does (lease, run_line, renew, release) and
checks what the client would read (batch object, output and error files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.batch_schema import SCHEMA_VERSION, BatchStoreError
from iop_edge.adapters.batch_store import SqliteBatchStore
from iop_edge.adapters.pg_batch_store import PostgresBatchStore
from iop_edge.adapters.run_wire import run_event
from iop_edge.domain.events import Failed, RunEvent
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry, Operation
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.errors import (
    EdgeError,
    InvalidRequest,
    LeaseLost,
    NotFound,
    ProviderFailed,
    QueueTimeout,
    RequestTooLarge,
    from_failure,
)
from iop_edge.formats.errors import error_payload
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


CHAT = "/v1/chat/completions"
SERVED = "served-name"
T0 = 1_750_000_000.0
TTL = 30.0
WAIT = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeRun:
    """Events of one run; a ``gate`` holds the terminal event back until the test sets it."""

    def __init__(
        self, runs: FakeRuns, spec: RunSpec, run_id: str, gate: asyncio.Event | None = None
    ) -> None:
        self.runs = runs
        self.run_id = run_id
        self.provider_id, self.node_id, self.target = "p1", "n1", SERVED
        self.node_wait_ms = 0
        self.spec = spec
        self.gate = gate
        self.cancel_reasons: list[str] = []
        self._cancelled = asyncio.Event()

    _reading: AsyncIterator[RunEvent] | None = None

    async def next_events(self) -> tuple[RunEvent, ...]:
        if self._reading is None:
            self._reading = as_events(self._events())
        return await one_at_a_time(self._reading)

    async def _events(self) -> AsyncIterator[pb.RunEvent]:
        yield pb.RunEvent(run_id=self.run_id, start=pb.RunStart(provider_id="p1", target=SERVED))
        if self.gate is not None:
            waits = [asyncio.ensure_future(w.wait()) for w in (self.gate, self._cancelled)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self._cancelled.is_set():
                yield pb.RunEvent(
                    error=pb.RunError(code=pb.ERROR_CODE_CANCELLED, message="cancelled")
                )
                return
        if self.spec.model == "broken":
            yield pb.RunEvent(
                error=pb.RunError(code=pb.ERROR_CODE_PROVIDER_ERROR, message="the GPU caught fire")
            )
            return
        result = {
            "id": f"chatcmpl-{self.run_id}",
            "object": "chat.completion",
            "created": 1,
            "model": SERVED,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"echo {self.spec.body['n']}"},
                    "finish_reason": "stop",
                }
            ],
        }
        usage = pb.Usage(prompt_tokens=7, completion_tokens=self.spec.body["n"] + 1)
        complete = pb.RunComplete(result_json=json.dumps(result).encode(), usage=usage)
        yield pb.RunEvent(run_id=self.run_id, complete=complete)

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        if self._cancelled.is_set():
            return  # ended already: the first end wins
        self.cancel_reasons.append(reason)
        self._cancelled.set()

    @property
    def ended(self) -> bool:
        return self._cancelled.is_set()

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        return ()  # one attempt, on the provider it names

    def error(self, failed: Failed) -> EdgeError:
        return from_failure(failed)

    async def open(self) -> None:
        """What the service's queue does to the run: ``busy`` finds no room, ``queued``
        waits for a ``slot`` first, and leaves the queue when it is ended meanwhile."""
        runs, model = self.runs, self.spec.model
        if model == "busy":
            raise QueueTimeout("no slot in time")
        if model == "bug":
            raise RuntimeError("a bug in dispatch")
        if model == "huge":
            raise RequestTooLarge("its run would not fit in a frame")
        if model == "queued":
            runs.queued.set()
            waits = [asyncio.ensure_future(w.wait()) for w in (runs.slot, self._cancelled)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self._cancelled.is_set():
                raise ProviderFailed(self.cancel_reasons[0], code="cancelled")
        runs.started.set()


class FakeRuns:
    """``RunService``: counts every run; ``busy`` finds no room, ``slow`` waits for ``gate``,
    ``queued`` waits for a ``slot`` first (in the model's queue), then for ``gate``."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []
        self.runs: list[FakeRun] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.slot = asyncio.Event()
        self.queued = asyncio.Event()

    def admit(self, spec: RunSpec) -> FakeRun:
        self.specs.append(spec)
        gated = spec.model in ("slow", "queued")
        run = FakeRun(self, spec, f"run-{len(self.specs)}", self.gate if gated else None)
        self.runs.append(run)
        return run


class FakeCatalog:
    def __init__(self, *model_ids: str) -> None:
        self.entries = {m: ModelEntry(m, m, {"p1": SERVED}) for m in model_ids}

    def models(self) -> list[ModelEntry]:
        return list(self.entries.values())

    def model(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)

    def provider_views(self) -> list[dict[str, Any]]:
        return []

    def model_views(self) -> list[dict[str, Any]]:
        return []

    def any_available(self) -> bool:
        return True


Backend = Any  # conftest's BatchBackend (a conftest cannot be imported)


class Harness:
    def __init__(self, store: SqliteBatchStore | PostgresBatchStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.runs = FakeRuns()
        self.registry = CollectorRegistry()
        self.accounted: list[EdgeRunRecord] = []  # each line's run, once ended
        self.service = BatchService(
            store,
            self.runs,
            FakeCatalog("good", "broken", "busy", "slow", "bug", "huge", "queued"),
            self.registry,
            lease_ttl_s=TTL,
            clock=clock,
            max_file_bytes=10_000,
            max_body_bytes=1_000,
            account=self.accounted.append,
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def upload(
        self,
        content: bytes,
        purpose: str = "batch",
        *,
        key: ApiKeyEntry | None = None,
        chunk: int = 4096,
    ) -> dict[str, Any]:
        """Upload ``content`` the way the HTTP route does: chunk by chunk."""
        async with self.service.receive_file() as upload:
            for start in range(0, len(content), chunk):
                await upload.write(content[start : start + chunk])
            return await self.service.create_file(upload, "in.jsonl", purpose, key=key)

    async def content(self, file_id: str, *, key: ApiKeyEntry | None = None) -> bytes:
        opened = await self.service.file_content(file_id, key=key)
        return b"".join([chunk async for chunk in opened.chunks()])

    async def batch(self, lines: list[dict[str, Any]] | bytes, **extra: Any) -> dict[str, Any]:
        content = lines if isinstance(lines, bytes) else jsonl(lines)
        file = await self.upload(content, key=extra.get("key"))
        return await self.service.create_batch(file["id"], CHAT, "24h", None, **extra)

    async def results(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        content = await self.content(file_id)
        return [json.loads(line) for line in content.decode().splitlines()]


@contextlib.asynccontextmanager
async def opened(backend: Backend, clock: FakeClock) -> AsyncIterator[Harness]:
    store = await backend.open()
    try:
        yield Harness(store, clock)
    finally:
        await store.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def h(batch_backend: Backend, clock: FakeClock) -> AsyncIterator[Harness]:
    async with opened(batch_backend, clock) as harness:
        yield harness


def request(custom_id: str, model: str = "good", n: int = 0, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": n}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body, **extra}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def three() -> list[dict[str, Any]]:
    return [request("a", n=1), request("b", model="nope"), request("c", model="broken")]


# ---------------------------------------------------------------- files


async def test_files_round_trip_and_404s(h: Harness) -> None:
    created = await h.upload(b'{"x": 1}\n')
    assert created["id"].startswith("file-")
    assert created == {
        "id": created["id"],
        "object": "file",
        "bytes": 9,
        "created_at": int(T0),
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }
    assert await h.service.get_file(created["id"]) == created
    assert await h.content(created["id"]) == b'{"x": 1}\n'
    deleted = await h.service.delete_file(created["id"])
    assert deleted == {"id": created["id"], "object": "file", "deleted": True}
    for call in (h.service.get_file, h.service.file_content, h.service.delete_file):
        with pytest.raises(NotFound) as caught:
            await call(created["id"])
        assert error_payload(caught.value) == {
            "error": {
                "message": f"No such File object: {created['id']}",
                "type": "invalid_request_error",
                "param": "id",
                "code": None,
            }
        }
        assert caught.value.status == 404


async def test_an_upload_needs_purpose_batch_and_a_modest_size(h: Harness) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await h.upload(b"{}", "fine-tune")
    assert caught.value.param == "purpose"
    with pytest.raises(InvalidRequest) as caught:
        await h.upload(b"x" * 10_001)
    assert (caught.value.param, caught.value.status) == ("file", 400)


async def test_the_store_file_is_owner_only_and_versioned(tmp_path: Path) -> None:
    path = tmp_path / "state" / "batches.db"
    store = await SqliteBatchStore.open(path)
    await store.aclose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        raw.close()


async def test_a_store_from_a_newer_edge_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "batches.db"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(BatchStoreError, match="newer"):
        await SqliteBatchStore.open(path)


# ---------------------------------------------------------------- tenancy

KEY_A = ApiKeyEntry("key_a", "a", "hash-a", frozenset(), 0)
KEY_B = ApiKeyEntry("key_b", "b", "hash-b", frozenset(), 0)
OPERATOR = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)


async def finished_batch(h: Harness, key: ApiKeyEntry | None) -> dict[str, Any]:
    """A batch of ``key`` run to its end, with an output and an error file."""
    batch = await h.batch([request("a"), request("b", model="broken")], key=key)
    grant = await h.service.lease("w1")
    await run_all(h, grant)
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"], key=key)
    assert done["status"] == "completed"
    assert done["output_file_id"] is not None
    assert done["error_file_id"] is not None
    return done


async def test_another_key_is_told_each_object_does_not_exist(h: Harness) -> None:
    done = await finished_batch(h, KEY_A)
    file_id = done["input_file_id"]
    unknown_file, unknown_batch = "file-" + "0" * 32, "batch_" + "0" * 32

    async def refusal(call: Any, object_id: str, **kwargs: Any) -> dict[str, Any]:
        with pytest.raises(NotFound) as caught:
            await call(object_id, key=KEY_B, **kwargs)
        return error_payload(caught.value)

    def same(payload: dict[str, Any], object_id: str, unknown_id: str) -> dict[str, Any]:
        return json.loads(json.dumps(payload).replace(object_id, unknown_id))

    for object_id in (file_id, done["output_file_id"], done["error_file_id"]):
        for call in (h.service.get_file, h.service.file_content, h.service.delete_file):
            payload = await refusal(call, object_id)
            assert same(payload, object_id, unknown_file) == await refusal(call, unknown_file)
    for call in (h.service.get_batch, h.service.cancel_batch):
        payload = await refusal(call, done["id"])
        assert same(payload, done["id"], unknown_batch) == await refusal(call, unknown_batch)
    with pytest.raises(NotFound) as caught:
        await h.service.create_batch(file_id, CHAT, "24h", None, key=KEY_B)
    assert caught.value.param == "input_file_id"

    assert (await h.service.list_batches(None, 10, key=KEY_B))["data"] == []
    assert (await h.service.list_files(None, None, 10, key=KEY_B))["data"] == []
    mine = await h.batch([request("mine")], key=KEY_B)
    # A's ids as cursors page B's lists like ids never issued: empty, nothing revealed.
    assert (await h.service.list_batches(done["id"], 10, key=KEY_B))["data"] == []
    for newest in (True, False):
        assert (await h.service.list_files(None, file_id, 10, newest=newest, key=KEY_B))[
            "data"
        ] == []
    assert [b["id"] for b in (await h.service.list_batches(None, 10, key=KEY_B))["data"]] == [
        mine["id"]
    ]
    # A still has everything, untouched by B's attempts.
    assert [b["id"] for b in (await h.service.list_batches(None, 10, key=KEY_A))["data"]] == [
        done["id"]
    ]
    listed = await h.service.list_files(None, None, 10, key=KEY_A)
    assert {f["id"] for f in listed["data"]} == {
        file_id,
        done["output_file_id"],
        done["error_file_id"],
    }
    assert (await h.results(done["output_file_id"]))[0]["custom_id"] == "a"
    assert await h.content(done["output_file_id"], key=KEY_A) == await h.content(
        done["output_file_id"]
    )


async def test_an_operator_key_and_the_open_api_see_and_act_on_everything(h: Harness) -> None:
    done = await finished_batch(h, KEY_A)
    for key in (OPERATOR, None):
        assert (await h.service.get_batch(done["id"], key=key))["id"] == done["id"]
        assert [b["id"] for b in (await h.service.list_batches(None, 10, key=key))["data"]] == [
            done["id"]
        ]
        assert len((await h.service.list_files(None, None, 10, key=key))["data"]) == 3
        assert (await h.content(done["output_file_id"], key=key)).startswith(b'{"id"')
    made = await h.service.create_batch(done["input_file_id"], CHAT, "24h", None, key=OPERATOR)
    assert (await h.service.cancel_batch(made["id"], key=OPERATOR))["status"] == "cancelled"
    with pytest.raises(NotFound):  # the operator's batch is the operator's
        await h.service.get_batch(made["id"], key=KEY_A)
    await h.service.delete_file(done["output_file_id"], key=OPERATOR)
    with pytest.raises(NotFound):
        await h.service.get_file(done["output_file_id"], key=KEY_A)


async def test_objects_made_while_the_api_was_open_are_only_for_operators(h: Harness) -> None:
    done = await finished_batch(h, None)
    for key in (KEY_A, KEY_B):
        with pytest.raises(NotFound):
            await h.service.get_batch(done["id"], key=key)
        with pytest.raises(NotFound):
            await h.service.get_file(done["output_file_id"], key=key)
        assert (await h.service.list_files(None, None, 10, key=key))["data"] == []
    assert (await h.service.get_file(done["output_file_id"], key=OPERATOR))["id"]


async def test_the_file_list_filters_orders_and_pages(h: Harness) -> None:
    ids = [(await h.upload(jsonl([request(str(n))]), key=KEY_A))["id"] for n in range(3)]
    await finished_batch(h, KEY_B)
    page = await h.service.list_files(None, None, 2, key=KEY_A)
    assert ([f["id"] for f in page["data"]], page["has_more"]) == ([ids[2], ids[1]], True)
    rest = await h.service.list_files(None, page["last_id"], 2, key=KEY_A)
    assert ([f["id"] for f in rest["data"]], rest["has_more"]) == ([ids[0]], False)
    oldest = await h.service.list_files(None, None, 10, newest=False, key=KEY_A)
    assert [f["id"] for f in oldest["data"]] == ids
    outputs = await h.service.list_files("batch_output", None, 10, key=KEY_B)
    assert {f["purpose"] for f in outputs["data"]} == {"batch_output"}
    assert len(outputs["data"]) == 2
    assert page["object"] == "list"
    assert page["first_id"] == ids[2]


# ---------------------------------------------------------------- create and validate


async def test_every_validation_rule_names_its_line(h: Harness) -> None:
    lines = [
        json.dumps(request("ok")),
        "{not json",
        json.dumps({k: v for k, v in request("x").items() if k != "custom_id"}),
        json.dumps(request("ok")),  # duplicate custom_id
        json.dumps(request("get", method="GET")),
        json.dumps(request("emb", url="/v1/embeddings")),
        "",  # blank lines are skipped, not counted as errors
        json.dumps({k: v for k, v in request("nobody").items() if k != "body"}),
        "[1, 2]",
    ]
    batch = await h.batch("\n".join(lines).encode())
    assert batch["status"] == "failed"
    assert batch["failed_at"] == int(T0)
    assert batch["errors"]["object"] == "list"
    found = [(e["line"], e["code"], e["param"]) for e in batch["errors"]["data"]]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "invalid_method", "method"),
        (6, "invalid_url", "url"),
        (8, "missing_required_parameter", "body"),
        (9, "invalid_json_line", None),
    ]
    assert all(e["message"] for e in batch["errors"]["data"])
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert (await h.service.lease("w1")).batch_id == ""  # nothing runs
    assert h.runs.specs == []
    assert h.metric("iop_edge_batches", status="failed") == 1


async def test_an_empty_file_fails_the_batch(h: Harness) -> None:
    batch = await h.batch(b"\n\n")
    assert batch["status"] == "failed"
    assert [e["code"] for e in batch["errors"]["data"]] == ["empty_file"]


async def test_batch_parameters_are_checked(h: Harness) -> None:
    file = await h.upload(jsonl([request("a")]))
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((file["id"], "/v1/responses", "24h", None), "endpoint"),
        ((file["id"], CHAT, "1h", None), "completion_window"),
        ((file["id"], CHAT, "24h", {"k": 1}), "metadata"),
        ((file["id"], CHAT, "24h", {f"k{i}": "v" for i in range(17)}), "metadata"),
    ]
    for args, param in cases:
        with pytest.raises(InvalidRequest) as caught:
            await h.service.create_batch(*args)
        assert caught.value.param == param
    with pytest.raises(NotFound) as missing:
        await h.service.create_batch("file-nope", CHAT, "24h", None)
    assert missing.value.message == "No such File object: file-nope"


async def test_a_valid_batch_is_an_openai_batch_object(h: Harness) -> None:
    file = await h.upload(jsonl(three()))
    batch = await h.service.create_batch(file["id"], CHAT, "24h", {"team": "search"})
    assert batch["id"].startswith("batch_")
    assert batch == {
        "id": batch["id"],
        "object": "batch",
        "endpoint": CHAT,
        "errors": None,
        "input_file_id": file["id"],
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(T0),
        "in_progress_at": None,
        "expires_at": int(T0) + 24 * 3600,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 3, "completed": 0, "failed": 0},
        "metadata": {"team": "search"},
    }
    assert await h.service.get_batch(batch["id"]) == batch
    with pytest.raises(NotFound):
        await h.service.get_batch("batch_nope")


async def test_list_is_newest_first_with_a_cursor(h: Harness) -> None:
    ids = [(await h.batch([request("a")]))["id"] for _ in range(3)]
    page = await h.service.list_batches(None, 2)
    assert [b["id"] for b in page["data"]] == ids[::-1][:2]
    assert (page["object"], page["has_more"]) == ("list", True)
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    rest = await h.service.list_batches(page["last_id"], 2)
    assert [b["id"] for b in rest["data"]] == [ids[0]]
    assert rest["has_more"] is False


# ---------------------------------------------------------------- running


async def run_all(h: Harness, grant: LeaseGrant) -> list[LineReply]:
    return [
        await h.service.run_line(grant.lease_id, n)
        for n in range(grant.next_line, grant.total_lines)
    ]


async def test_a_batch_runs_to_completion_with_output_and_error_files(h: Harness) -> None:
    batch = await h.batch(three())
    grant = await h.service.lease("w1")
    assert (grant.batch_id, grant.endpoint, grant.next_line, grant.total_lines) == (
        batch["id"],
        CHAT,
        0,
        3,
    )
    assert grant.expires_at_unix_ms == int((T0 + TTL) * 1000)
    running = await h.service.get_batch(batch["id"])
    assert (running["status"], running["in_progress_at"]) == ("in_progress", int(T0))

    results = await run_all(h, grant)
    assert [(r.custom_id, r.status_code) for r in results] == [("a", 200), ("b", 404), ("c", 502)]
    assert json.loads(results[0].response_json)["model"] == "good"  # the public id
    assert json.loads(results[1].error_json)["error"]["code"] == "model_not_found"
    assert [s.model for s in h.runs.specs] == ["good", "broken"]  # unknown: never dispatched
    spec = h.runs.specs[0]
    assert (spec.operation, spec.stream, spec.include_usage, spec.batch) == (
        Operation.CHAT_COMPLETIONS,
        False,
        False,
        True,
    )

    h.clock.advance(5)
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    assert done["status"] == "completed"
    assert (done["finalizing_at"], done["completed_at"]) == (int(T0) + 5, int(T0) + 5)
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    output = await h.results(done["output_file_id"])
    errors = await h.results(done["error_file_id"])
    assert [line["custom_id"] for line in output] == ["a"]
    assert output[0]["id"].startswith("batch_req_")
    assert output[0]["error"] is None
    assert output[0]["response"]["status_code"] == 200
    assert output[0]["response"]["request_id"] == "run-1"
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == "echo 1"
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [
        ("b", 404),
        ("c", 502),
    ]
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors[1]["response"]["body"]["error"]["message"] == "the GPU caught fire"
    output_file = await h.service.get_file(done["output_file_id"])
    assert (output_file["purpose"], output_file["filename"]) == (
        "batch_output",
        f"{batch['id']}_output.jsonl",
    )
    assert h.metric("iop_edge_batch_lines_total", outcome="done") == 1
    assert h.metric("iop_edge_batch_lines_total", outcome="failed") == 2
    assert h.metric("iop_edge_batches", status="completed") == 1
    assert h.metric("iop_edge_batches", status="in_progress") == 0
    with pytest.raises(LeaseLost):
        await h.service.run_line(grant.lease_id, 0)


async def test_each_line_s_run_is_recorded_under_the_batch_s_owner_and_the_batch_api(
    h: Harness,
) -> None:
    """The run log and the metrics count a batch's lines as runs of the key that owns
    the batch, on the API ``batch``: every try, done, failed, without room or abandoned."""
    lines = [*three(), request("d", model="busy"), request("e", model="slow")]
    await h.batch(lines, key=KEY_A)
    grant = await h.service.lease("w1")
    for n in range(4):
        await h.service.run_line(grant.lease_id, n)
    h.runs.started.clear()  # set by the lines before
    call = asyncio.create_task(h.service.run_line(grant.lease_id, 4))
    async with asyncio.timeout(WAIT):
        await h.runs.started.wait()
    call.cancel()  # the worker's connection dropped
    with pytest.raises(asyncio.CancelledError):
        await call

    assert {(r.key_id, r.api, r.stream) for r in h.accounted} == {("key_a", "batch", False)}
    assert [(r.model, r.outcome, r.status, r.error_code) for r in h.accounted] == [
        ("good", "completed", 200, ""),
        ("", "rejected", 404, "model_not_found"),  # never a run, and no model label
        ("broken", "failed", 502, "provider_error"),
        ("busy", "rejected", 503, "queue_timeout"),  # no room: run again later
        ("slow", "cancelled", 499, "worker_gone"),
    ]
    done = h.accounted[0]
    assert (done.run_id, done.provider_id, done.node_id) == ("run-1", "p1", "n1")
    assert (done.prompt_tokens, done.completion_tokens, done.operation) == (
        7,
        2,
        "chat_completions",
    )
    assert h.accounted[1].run_id.startswith("req-")
    assert len({r.run_id for r in h.accounted}) == 5  # five rows in the run log
    assert all(r.duration_ms >= 1 and r.received_ms > 0 for r in h.accounted)


async def test_only_non_empty_result_files_are_written(h: Harness) -> None:
    batch = await h.batch([request("a"), request("b")])
    grant = await h.service.lease("w1")
    await run_all(h, grant)
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    assert done["output_file_id"] is not None
    assert done["error_file_id"] is None


async def test_a_finished_line_is_never_run_again(h: Harness) -> None:
    await h.batch(three())
    grant = await h.service.lease("w1")
    first = await h.service.run_line(grant.lease_id, 0)
    again = await h.service.run_line(grant.lease_id, 0)
    assert again == first
    assert len(h.runs.specs) == 1
    assert h.metric("iop_edge_batch_lines_total", outcome="done") == 1


async def test_the_same_line_asked_twice_at_once_shares_one_run(h: Harness) -> None:
    await h.batch([request("s", model="slow")])
    grant = await h.service.lease("w1")
    calls = [asyncio.create_task(h.service.run_line(grant.lease_id, 0)) for _ in range(2)]
    async with asyncio.timeout(WAIT):
        await h.runs.started.wait()
        h.runs.gate.set()
        first, second = await asyncio.gather(*calls)
    assert first == second
    assert first.status_code == 200
    assert len(h.runs.specs) == 1


async def test_a_line_out_of_range_is_not_found(h: Harness) -> None:
    await h.batch([request("a")])
    grant = await h.service.lease("w1")
    with pytest.raises(NotFound):
        await h.service.run_line(grant.lease_id, 1)


async def test_a_line_whose_key_may_not_use_its_model_fails_without_running(h: Harness) -> None:
    key = ApiKeyEntry("k1", "k1", "hash", frozenset({"good"}), 0)
    batch = await h.batch([request("a"), request("b", model="broken")], key=key)
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    grant = await h.service.lease("w1")
    results = await run_all(h, grant)
    assert [r.status_code for r in results] == [200, 403]
    assert [s.model for s in h.runs.specs] == ["good"]
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    (error,) = await h.results(done["error_file_id"])
    assert error["response"]["body"]["error"]["code"] == "model_not_allowed"


def drilled(custom_id: str) -> dict[str, Any]:
    line = request(custom_id)
    line["body"]["iop_mock"] = {"fail": "provider_error"}
    return line


async def test_a_plain_key_s_drill_line_fails_without_running_an_operator_s_runs(
    h: Harness,
) -> None:
    """The mock's failure drills (domain/drills.py): a plain key's line asking one fails
    alone (400 naming iop_mock), as the same request over HTTP would; an operator's runs,
    marked as a drill (its failure never counts against the provider)."""
    plain = ApiKeyEntry("k1", "k1", "hash", frozenset(), 0)
    operator = ApiKeyEntry("k2", "k2", "hash2", frozenset(), 0, operator=True)
    batch = await h.batch([request("a"), drilled("b")], key=plain)
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    grant = await h.service.lease("w1")
    results = await run_all(h, grant)
    assert [r.status_code for r in results] == [200, 400]
    assert [s.drill for s in h.runs.specs] == [False]
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    (error,) = await h.results(done["error_file_id"])
    assert error["response"]["body"]["error"]["param"] == "iop_mock"

    await h.batch([drilled("c")], key=operator)
    grant = await h.service.lease("w1")
    await run_all(h, grant)
    assert [s.drill for s in h.runs.specs] == [False, True]


async def test_a_line_over_the_body_limit_fails_alone_and_the_batch_completes(
    h: Harness,
) -> None:
    big = request("big")
    big["body"]["messages"][0]["content"] = "x" * 1_000
    batch = await h.batch([request("a"), big, request("c")])
    assert batch["status"] == "validating"
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    grant = await h.service.lease("w1")
    results = await run_all(h, grant)
    assert [r.status_code for r in results] == [200, 413, 200]
    assert len(h.runs.specs) == 2  # the big one never reached dispatch
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    assert done["status"] == "completed"
    (error,) = await h.results(done["error_file_id"])
    assert error["custom_id"] == "big"
    assert error["response"]["status_code"] == 413
    body = error["response"]["body"]["error"]
    assert body["code"] == "request_too_large"
    assert "limit of 1000 bytes" in body["message"]


@pytest.mark.parametrize(
    ("model", "status", "code"),
    [("bug", 500, "internal_error"), ("huge", 413, "request_too_large")],
)
async def test_a_line_the_edge_cannot_run_fails_into_the_error_file(
    h: Harness, model: str, status: int, code: str
) -> None:
    batch = await h.batch([request("a", model=model), request("b")])
    grant = await h.service.lease("w1")
    results = await run_all(h, grant)
    assert [r.status_code for r in results] == [status, 200]
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    assert (done["status"], done["request_counts"]["failed"]) == ("completed", 1)
    (error,) = await h.results(done["error_file_id"])
    assert error["response"]["body"]["error"]["code"] == code


async def test_a_line_nested_past_the_limit_fails_validation_naming_it(h: Harness) -> None:
    deep = request("deep")
    deep["body"]["messages"][0]["content"] = json.loads("[" * 70 + "]" * 70)
    batch = await h.batch(jsonl([request("a")]) + json.dumps(deep).encode() + b"\n")
    assert batch["status"] == "failed"
    (error,) = batch["errors"]["data"]
    assert error["line"] == 2
    assert "nested deeper than 64 levels" in error["message"]


# ---------------------------------------------------------------- leases


async def test_a_second_lease_while_the_first_is_live_gets_nothing(h: Harness) -> None:
    await h.batch(three())
    first = await h.service.lease("w1")
    assert first.batch_id
    h.clock.advance(TTL - 1)
    assert (await h.service.lease("w2")).batch_id == ""


async def test_renewal_extends_the_lease(h: Harness) -> None:
    await h.batch(three())
    grant = await h.service.lease("w1")
    h.clock.advance(20)
    renewed = await h.service.renew(grant.lease_id)
    assert renewed.expires_at_unix_ms == int((T0 + 20 + TTL) * 1000)
    assert (renewed.batch_id, renewed.lease_id) == (grant.batch_id, grant.lease_id)
    h.clock.advance(20)  # 40 s after the lease, 20 after the renewal
    assert (await h.service.lease("w2")).batch_id == ""
    assert h.metric("iop_edge_batch_lease_renewals_total") == 1


async def test_after_expiry_another_worker_resumes_at_the_first_unfinished_line(
    h: Harness,
) -> None:
    await h.batch(three())
    old = await h.service.lease("w1")
    await h.service.run_line(old.lease_id, 0)
    h.clock.advance(TTL + 1)
    new = await h.service.lease("w2")
    assert (new.batch_id, new.next_line, new.total_lines) == (old.batch_id, 1, 3)
    assert new.lease_id != old.lease_id
    assert h.metric("iop_edge_batch_lease_expiries_total") == 1
    with pytest.raises(LeaseLost):
        await h.service.renew(old.lease_id)
    with pytest.raises(LeaseLost):
        await h.service.run_line(old.lease_id, 1)
    await h.service.release(old.lease_id, finished=True)  # stale: changes nothing
    assert (await h.service.get_batch(old.batch_id))["status"] == "in_progress"
    await run_all(h, new)
    await h.service.release(new.lease_id, finished=True)
    done = await h.service.get_batch(old.batch_id)
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert len(h.runs.specs) == 2  # line 0 ran once, under the first lease


async def test_an_expired_lease_not_yet_taken_can_still_be_renewed(h: Harness) -> None:
    await h.batch(three())
    grant = await h.service.lease("w1")
    h.clock.advance(TTL + 5)
    renewed = await h.service.renew(grant.lease_id)
    assert renewed.batch_id == grant.batch_id


async def test_a_release_unfinished_frees_the_batch_at_once(h: Harness) -> None:
    await h.batch(three())
    grant = await h.service.lease("w1")
    await h.service.run_line(grant.lease_id, 0)
    await h.service.release(grant.lease_id, finished=False)
    again = await h.service.lease("w2")
    assert (again.batch_id, again.next_line) == (grant.batch_id, 1)
    assert h.metric("iop_edge_batch_lease_expiries_total") == 0


async def test_a_line_without_room_stays_pending_and_is_retried(h: Harness) -> None:
    batch = await h.batch([request("a"), request("b", model="busy")])
    grant = await h.service.lease("w1")
    results = await run_all(h, grant)
    assert [r.status_code for r in results] == [200, 503]
    assert json.loads(results[1].error_json)["error"]["code"] == "queue_timeout"
    await h.service.release(grant.lease_id, finished=True)
    waiting = await h.service.get_batch(batch["id"])
    assert waiting["status"] == "in_progress"
    assert waiting["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert (await h.service.lease("w1")).batch_id == ""  # resting after a retry
    h.clock.advance(10)
    retry = await h.service.lease("w1")
    assert (retry.batch_id, retry.next_line) == (batch["id"], 1)


async def test_an_abandoned_line_cancels_its_run_and_stays_pending(h: Harness) -> None:
    await h.batch([request("s", model="slow")])
    grant = await h.service.lease("w1")
    call = asyncio.create_task(h.service.run_line(grant.lease_id, 0))
    async with asyncio.timeout(WAIT):
        await h.runs.started.wait()
    call.cancel()  # the worker's connection dropped
    with pytest.raises(asyncio.CancelledError):
        await call
    assert h.runs.runs[0].cancel_reasons == ["the batch line was abandoned"]
    h.runs.gate.set()
    again = await h.service.run_line(grant.lease_id, 0)
    assert again.status_code == 200
    assert len(h.runs.specs) == 2


async def test_a_batch_past_its_window_expires_with_its_finished_lines(h: Harness) -> None:
    batch = await h.batch(three())
    grant = await h.service.lease("w1")
    await h.service.run_line(grant.lease_id, 0)
    h.clock.advance(24 * 3600)
    with pytest.raises(LeaseLost):
        await h.service.renew(grant.lease_id)
    expired = await h.service.get_batch(batch["id"])
    assert (expired["status"], expired["expired_at"]) == ("expired", int(T0) + 24 * 3600)
    assert [line["custom_id"] for line in await h.results(expired["output_file_id"])] == ["a"]
    errors = await h.results(expired["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_expired"),
        ("c", "batch_expired"),
    ]
    assert all(e["response"] is None for e in errors)


async def test_an_unleased_batch_past_its_window_expires_at_the_next_lease(h: Harness) -> None:
    batch = await h.batch(three())
    h.clock.advance(24 * 3600 + 1)
    assert (await h.service.lease("w1")).batch_id == ""
    assert (await h.service.get_batch(batch["id"]))["status"] == "expired"


# ---------------------------------------------------------------- cancel


async def test_cancel_while_leased_is_cancelling_then_cancelled_on_release(h: Harness) -> None:
    batch = await h.batch(three())
    grant = await h.service.lease("w1")
    await h.service.run_line(grant.lease_id, 0)
    h.clock.advance(3)
    cancelling = await h.service.cancel_batch(batch["id"])
    assert (cancelling["status"], cancelling["cancelling_at"]) == ("cancelling", int(T0) + 3)
    with pytest.raises(LeaseLost):
        await h.service.renew(grant.lease_id)
    with pytest.raises(LeaseLost):
        await h.service.run_line(grant.lease_id, 1)
    await h.service.release(grant.lease_id, finished=False)
    cancelled = await h.service.get_batch(batch["id"])
    assert (cancelled["status"], cancelled["cancelled_at"]) == ("cancelled", int(T0) + 3)
    assert cancelled["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert [line["custom_id"] for line in await h.results(cancelled["output_file_id"])] == ["a"]
    errors = await h.results(cancelled["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
    ]
    assert await h.service.cancel_batch(batch["id"]) == cancelled  # as is
    assert h.metric("iop_edge_batches", status="cancelled") == 1


async def test_cancel_without_a_worker_is_cancelled_at_once(h: Harness) -> None:
    batch = await h.batch(three())
    cancelled = await h.service.cancel_batch(batch["id"])
    assert cancelled["status"] == "cancelled"
    assert cancelled["output_file_id"] is None
    assert len(await h.results(cancelled["error_file_id"])) == 3
    assert (await h.service.lease("w1")).batch_id == ""


async def test_a_cancelling_batch_whose_worker_vanished_is_cancelled_at_expiry(
    h: Harness,
) -> None:
    batch = await h.batch(three())
    await h.service.lease("w1")
    await h.service.cancel_batch(batch["id"])
    h.clock.advance(TTL + 1)
    assert (await h.service.lease("w2")).batch_id == ""  # never leased, but finalized
    assert (await h.service.get_batch(batch["id"]))["status"] == "cancelled"
    assert h.metric("iop_edge_batch_lease_expiries_total") == 1


async def test_a_finished_batch_cannot_be_cancelled(h: Harness) -> None:
    batch = await h.batch([request("a")])
    grant = await h.service.lease("w1")
    await run_all(h, grant)
    await h.service.release(grant.lease_id, finished=True)
    done = await h.service.get_batch(batch["id"])
    assert await h.service.cancel_batch(batch["id"]) == done
    with pytest.raises(NotFound):
        await h.service.cancel_batch("batch_nope")


async def test_a_line_in_flight_when_its_batch_ends_is_stopped_and_not_stored(
    h: Harness,
) -> None:
    batch = await h.batch([request("a"), request("s", model="slow")])
    grant = await h.service.lease("w1")
    await h.service.run_line(grant.lease_id, 0)
    h.runs.started.clear()  # line 0 set it: wait for line 1's own start
    call = asyncio.create_task(h.service.run_line(grant.lease_id, 1))
    async with asyncio.timeout(WAIT):
        await h.runs.started.wait()
        await h.service.cancel_batch(batch["id"])
        await h.service.release(grant.lease_id, finished=False)
        result = await call
    assert result.status_code == 502  # cancelled from the edge's side: not stored
    cancelled = await h.service.get_batch(batch["id"])
    assert cancelled["status"] == "cancelled"
    assert cancelled["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert [e["custom_id"] for e in await h.results(cancelled["error_file_id"])] == ["s"]


async def test_a_revoked_keys_batches_are_cancelled_at_once_and_others_go_on(h: Harness) -> None:
    running = await h.batch([request("a"), request("s", model="slow"), request("c")], key=KEY_A)
    waiting = await h.batch([request("w")], key=KEY_A)
    kept = await h.batch([request("k")], key=KEY_B)
    unowned = await h.batch([request("o")])  # made while the API was open
    grant = await h.service.lease("w1")
    assert grant.batch_id == running["id"]
    await h.service.run_line(grant.lease_id, 0)
    h.runs.started.clear()
    call = asyncio.create_task(h.service.run_line(grant.lease_id, 1))
    async with asyncio.timeout(WAIT):
        await h.runs.started.wait()
        h.clock.advance(2)
        # KEY_A left the fleet: both of its batches end now, its worker not waited for.
        assert await h.service.apply_keys(frozenset({KEY_B.key_id})) == 2
        result = await call
    assert result.status_code == 502  # the line in flight was stopped, and not stored
    assert h.runs.runs[-1].cancel_reasons == ["the batch is cancelled"]
    ended = await h.service.get_batch(running["id"])
    assert (ended["status"], ended["cancelling_at"], ended["cancelled_at"]) == (
        "cancelled",
        int(T0) + 2,
        int(T0) + 2,
    )
    assert ended["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert [line["custom_id"] for line in await h.results(ended["output_file_id"])] == ["a"]
    errors = await h.results(ended["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("s", "batch_cancelled"),
        ("c", "batch_cancelled"),
    ]
    with pytest.raises(LeaseLost):
        await h.service.renew(grant.lease_id)
    never_ran = await h.service.get_batch(waiting["id"])
    assert (never_ran["status"], never_ran["output_file_id"]) == ("cancelled", None)
    assert len(await h.results(never_ran["error_file_id"])) == 1
    # Other keys' batches, and the open API's, are untouched and lease as before.
    for other in (kept, unowned):
        assert (await h.service.get_batch(other["id"]))["status"] == "validating"
    assert await h.service.apply_keys(frozenset({KEY_B.key_id})) == 0  # once
    assert (await h.service.lease("w1")).batch_id == kept["id"]
    assert h.metric("iop_edge_batches", status="cancelled") == 2


async def test_a_cancelling_batch_of_a_revoked_key_does_not_wait_for_its_worker(
    h: Harness,
) -> None:
    batch = await h.batch(three(), key=KEY_A)
    grant = await h.service.lease("w1")
    await h.service.run_line(grant.lease_id, 0)
    assert (await h.service.cancel_batch(batch["id"]))["status"] == "cancelling"
    assert await h.service.apply_keys(frozenset()) == 1
    cancelled = await h.service.get_batch(batch["id"])
    assert cancelled["status"] == "cancelled"
    assert cancelled["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert h.metric("iop_edge_batch_lease_expiries_total") == 0  # its lease was live


async def test_a_line_waiting_for_a_slot_when_its_batch_ends_stops_in_the_queue(
    h: Harness,
) -> None:
    batch = await h.batch([request("q", model="queued")], key=KEY_A)
    grant = await h.service.lease("w1")
    call = asyncio.create_task(h.service.run_line(grant.lease_id, 0))
    async with asyncio.timeout(WAIT):
        await h.runs.queued.wait()
        assert await h.service.apply_keys(frozenset()) == 1
        h.runs.slot.set()
        result = await call
    assert result.status_code == 502  # its run ended where it waited, and not stored
    assert h.runs.runs[-1].cancel_reasons == ["the batch is cancelled"]
    cancelled = await h.service.get_batch(batch["id"])
    assert cancelled["status"] == "cancelled"
    assert cancelled["request_counts"] == {"total": 1, "completed": 0, "failed": 0}


# ---------------------------------------------------------------- crashes


async def test_the_store_survives_a_restart_mid_batch(
    batch_backend: Backend, clock: FakeClock
) -> None:
    async with opened(batch_backend, clock) as before:
        batch = await before.batch(three())
        grant = await before.service.lease("w1")
        first = await before.service.run_line(grant.lease_id, 0)
    clock.advance(TTL + 1)  # the old lease dies with the old process
    async with opened(batch_backend, clock) as after:
        resumed = await after.service.lease("w2")
        assert (resumed.batch_id, resumed.next_line) == (batch["id"], 1)
        assert await after.service.run_line(resumed.lease_id, 0) == LineReply(
            lease_id=resumed.lease_id,
            line_number=0,
            custom_id="a",
            status_code=200,
            response_json=first.response_json,
        )
        assert after.runs.specs == []  # answered from storage
        await run_all(after, resumed)
        await after.service.release(resumed.lease_id, finished=True)
        done = await after.service.get_batch(batch["id"])
        assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}


async def test_a_finalize_cut_short_is_finished_by_the_next_lease(
    batch_backend: Backend, clock: FakeClock
) -> None:
    async with opened(batch_backend, clock) as before:
        batch = await before.batch([request("a")])
        grant = await before.service.lease("w1")
        await run_all(before, grant)
        await before.store.begin_finalize(batch["id"], "completed", int(clock()))  # then: crash
    async with opened(batch_backend, clock) as after:
        assert (await after.service.get_batch(batch["id"]))["status"] == "finalizing"
        assert (await after.service.lease("w2")).batch_id == ""
        done = await after.service.get_batch(batch["id"])
        assert done["status"] == "completed"
        assert [line["custom_id"] for line in await after.results(done["output_file_id"])] == ["a"]


async def test_a_connection_that_ends_frees_only_the_leases_granted_on_it(h: Harness) -> None:
    """A worker abandons a lease with its connection: the batch is leased again at once
    (not at the TTL); a lease taken over by another worker meanwhile stays that one's."""
    batch = await h.batch(three())
    first = await h.service.lease("w1")
    assert first.batch_id == batch["id"]
    await h.service.connection_ended("w2", [first.lease_id])  # not w2's: left alone
    assert (await h.service.lease("w2")).batch_id == ""
    await h.service.connection_ended("w1", [first.lease_id])
    again = await h.service.lease("w2")
    assert (again.batch_id, again.next_line) == (batch["id"], 0)
    await h.service.connection_ended("w1", [first.lease_id])  # w2 holds it now
    assert await h.service.lease_holder(again.lease_id) == "w2"


async def test_a_reconnecting_worker_frees_the_leases_it_held(h: Harness) -> None:
    """After an edge restart a worker registers again: its batch must not wait for the TTL."""
    batch = await h.batch(three())
    first = await h.service.lease("w1")
    assert first.batch_id == batch["id"]
    assert (await h.service.lease("w2")).batch_id == ""
    await h.service.worker_registered("w1")
    again = await h.service.lease("w1")
    assert again.batch_id == batch["id"]
    assert again.lease_id != first.lease_id
