"""Two edges on one PostgreSQL behind a balancer: one edge SIGKILLed under load,
PostgreSQL restarted under load, a response chain and a batch across an edge kill.

Every process is real: the control-plane, two edges sharing a real PostgreSQL 15
cluster (Debian's server, ``iop_proto.testing_postgres``), two nodes with mock
providers, a worker, and ``tools/tcp_balancer.py`` in front of the edges' HTTP ports, as
``make run HA=1`` runs them. Clients speak to the balancer only, one connection per
request (as a client whose kept-alive connection died opens a new one).

Each request ends in one of: completed; failed with a clear error (an OpenAI error
object, or the connection cut under it, which every HTTP client reports); lost (no
answer within the deadline, or one that is neither). The invariants, not timings:
nothing is lost, only requests in flight when the edge died may fail, and every
request sent after it died completes on the other edge; PostgreSQL restarting costs
inference nothing, storage calls answer 200 or a retryable 503 and every upload that
answered 200 is there after; a ``previous_response_id`` made on the killed edge continues
on the other; a batch's lines end exactly once per ``custom_id`` across the kill. The
nodes and the worker are given the first edge only and learn the second from the
control-plane's list of edges.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from iop_proto.testing_postgres import PostgresServer, why_postgres_cannot_run

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MODEL = "ha-pool"
BALANCER = Path(__file__).resolve().parents[2] / "tools" / "tcp_balancer.py"
CONCURRENCY = 8
REQUEST_DEADLINE_S = 60.0  # far beyond a request's ~0.2 s: only a real hang reaches it
# Each provider takes every client at once (capacity) so no request waits on a queue
# bound: a 429 here would be the test's load, not the fault under test.
PROVIDER = {"capacity": CONCURRENCY, "max_queue": 64, "tokens_per_second": 100}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


@dataclass
class Ha:
    stack: Stack
    postgres: PostgresServer
    api_url: str  # the balancer's
    edge_urls: dict[str, str]  # each edge's own API, for reads that must see both


@dataclass
class Sent:
    started: float
    ended: float = 0.0
    outcome: Any = None


@dataclass
class Load:
    """N requests through the balancer, ``CONCURRENCY`` at a time; each one's times."""

    api_url: str
    faults: SimpleNamespace
    total: int
    sent: list[Sent] = field(default_factory=list)
    done: int = 0

    async def run(self) -> None:
        queue = iter(range(self.total))
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request
        async with aiohttp.ClientSession(connector=connector) as http:
            await asyncio.gather(*(self.client(http, queue) for _ in range(CONCURRENCY)))

    async def client(self, http: aiohttp.ClientSession, queue: Any) -> None:
        for _ in queue:
            record = Sent(time.monotonic())
            self.sent.append(record)
            record.outcome = await self.one(http)
            record.ended = time.monotonic()
            self.done += 1

    async def one(self, http: aiohttp.ClientSession) -> Any:
        outcome = self.faults.Outcome
        try:
            return await self.faults.stream_chat(http, self.api_url, BODY, REQUEST_DEADLINE_S)
        except aiohttp.ContentTypeError as exc:  # an answer that is not an OpenAI error
            return outcome("lost", exc.status, "not json")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return outcome("cut", 0, type(exc).__name__)  # the client was told: connection ended

    async def until_done(self, count: int) -> None:
        async with asyncio.timeout(120):
            while self.done < count:  # noqa: ASYNC110 - progress of the clients' tasks
                await asyncio.sleep(0.02)

    def counts(self) -> dict[str, int]:
        kinds = [s.outcome.kind for s in self.sent]
        return {
            "sent": len(self.sent),
            "completed": kinds.count("completed"),
            "failed": kinds.count("error") + kinds.count("cut"),
            "lost": kinds.count("hung") + kinds.count("lost"),
        }


async def start_balancer(backends: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """``tools/tcp_balancer.py`` on an ephemeral port; its URL from its ready line."""
    args = [arg for backend in backends for arg in ("--backend", backend)]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(BALANCER),
        *("--listen", "127.0.0.1:0", "--rest", "1", *args),
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    async with asyncio.timeout(30):
        while line := (await process.stdout.readline()).decode():
            if line.startswith("ready: balancer "):
                asyncio.get_running_loop().create_task(drain(process.stdout))
                return process, line.split()[-1]
    raise AssertionError("the balancer exited before its ready line")


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ha(
    tmp_path_factory: pytest.TempPathFactory,
    start_stack_factory: Callable[..., Any],
    faults: SimpleNamespace,
) -> AsyncIterator[Ha]:
    reason = why_postgres_cannot_run()
    if reason is not None:
        pytest.skip(reason)
    postgres = PostgresServer.start()  # its own cluster: this module restarts it
    try:
        dsn = postgres.create_database()
        root = tmp_path_factory.mktemp("ha")
        fleet = faults.pool_fleet(MODEL, "ha", **PROVIDER)
        async with start_stack_factory(root, fleet, {"postgres": {"dsn": dsn}}) as stack:
            stack.second_edge_settings()
            edge_b = await stack.start("edge-b")
            stack.pin_ports("edge-b")
            edges = {
                "edge": stack.api_url,
                "edge-b": f"http://127.0.0.1:{edge_b.ports['http']}/v1",
            }
            hosts = [url.removeprefix("http://").removesuffix("/v1") for url in edges.values()]
            balancer, url = await start_balancer(hosts)
            try:
                yield Ha(stack, postgres, f"{url}/v1", edges)
            finally:
                balancer.send_signal(signal.SIGTERM)
                await balancer.wait()
    finally:
        postgres.stop()


PROVIDERS = ("node-a-ha", "node-b-ha")


async def available_on_both(ha: Ha, faults: SimpleNamespace) -> None:
    """Until each edge has both nodes' providers available: the nodes, given the first edge
    alone, learnt the second from the control-plane's list and dialled it too."""

    seen: dict[str, dict[str, str]] = {}

    async def check() -> bool:
        for edge, url in ha.edge_urls.items():
            rows = await faults.catalog(url, "providers")
            seen[edge] = {r["provider_id"]: r["health"] for r in rows}
        return all(
            health.get(provider) == "available"
            for health in seen.values()
            for provider in PROVIDERS
        )

    try:
        await faults.eventually(check, timeout_s=30)
    except TimeoutError:
        raise AssertionError(f"not every edge has both providers available: {seen}") from None


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def both_edges(ha: Ha, faults: SimpleNamespace) -> None:
    """Each test starts with both edges serving: one a test killed is started again on its
    ports (the nodes dial it back), whether that test passed or not."""
    if ha.stack.services["edge"].process.returncode is not None:
        await ha.stack.start("edge")
    await available_on_both(ha, faults)


async def test_edge_sigkilled_under_load_loses_nothing(
    ha: Ha, faults: SimpleNamespace, report: Callable[[str], None]
) -> None:
    load = Load(ha.api_url, faults, total=240)
    running = asyncio.create_task(load.run())
    await load.until_done(60)
    killing = time.monotonic()
    await ha.stack.stop("edge", signal.SIGKILL)  # returns once the process is reaped
    dead = time.monotonic()
    await running

    in_flight = [s for s in load.sent if s.started < dead and s.ended > killing]
    after = [s for s in load.sent if s.started > dead]
    counts = load.counts()
    report(
        f"edge SIGKILLed under load: {counts} (in flight at the kill {len(in_flight)}, "
        f"sent after it {len(after)}, all of which completed: "
        f"{all(s.outcome.kind == 'completed' for s in after)})"
    )
    assert counts["sent"] == 240
    assert counts["lost"] == 0, [s.outcome for s in load.sent if s.outcome.kind in ("hung", "lost")]
    assert in_flight, "the kill landed while no request was running: nothing was tested"
    failed = [s for s in load.sent if s.outcome.kind != "completed"]
    assert all(s in in_flight for s in failed), [s.outcome for s in failed if s not in in_flight]
    assert after, "no request was sent after the kill"
    assert all(s.outcome.kind == "completed" for s in after), [
        s.outcome for s in after if s.outcome.kind != "completed"
    ]


@dataclass
class StorageCall:
    status: int
    code: str  # the error's code; "" on 200
    retry_after: str | None
    file_id: str = ""  # what a 200 committed
    content: bytes = b""


async def storage_calls(ha: Ha, stop: asyncio.Event) -> list[StorageCall]:
    """Upload small files through the balancer until ``stop``: each call's answer."""
    seen: list[StorageCall] = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        while not stop.is_set():
            content = f'{{"n": {len(seen)}}}\n'.encode()
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", content, filename=f"f{len(seen)}.jsonl")
            async with http.post(f"{ha.api_url}/files", data=form) as response:
                body = await response.json()
                call = StorageCall(response.status, "", response.headers.get("Retry-After"))
                if response.status == 200:
                    call.file_id, call.content = body["id"], content
                else:
                    call.code = body["error"]["code"]
                seen.append(call)
            await asyncio.sleep(0.05)
    return seen


async def test_postgres_restarted_under_load(
    ha: Ha, faults: SimpleNamespace, report: Callable[[str], None]
) -> None:
    load = Load(ha.api_url, faults, total=160)
    running = asyncio.create_task(load.run())
    stop = asyncio.Event()
    uploading = asyncio.create_task(storage_calls(ha, stop))
    await load.until_done(30)
    await asyncio.to_thread(ha.postgres.restart, 1.0)  # down (immediate), 1 s, up again
    await running
    stop.set()
    storage = await uploading

    counts = load.counts()
    statuses = {c.status: sum(1 for d in storage if d.status == c.status) for c in storage}
    committed = [c for c in storage if c.status == 200]
    report(
        f"PostgreSQL restarted under load: {counts}; file uploads by status {statuses}, "
        f"{len(committed)} committed"
    )
    assert counts == {"sent": 160, "completed": 160, "failed": 0, "lost": 0}, [
        s.outcome for s in load.sent if s.outcome.kind != "completed"
    ]
    assert storage, "no storage call was made during the load"
    assert {c.status for c in storage} <= {200, 503}, storage
    unavailable = [c for c in storage if c.status == 503]
    assert all(c.code == "storage_unavailable" and c.retry_after for c in unavailable)
    # Once the server is back, the store answers again, and every upload that answered 200
    # is there, whole, through either edge.
    async with aiohttp.ClientSession() as http:

        async def answers() -> bool:
            async with http.get(f"{ha.api_url}/files") as response:
                return response.status == 200

        await faults.eventually(answers, timeout_s=30)
        for url in ha.edge_urls.values():
            for call in committed:
                async with http.get(f"{url}/files/{call.file_id}/content") as response:
                    assert response.status == 200, (url, call.file_id)
                    assert await response.read() == call.content


async def respond(http: aiohttp.ClientSession, api_url: str, body: dict[str, Any]) -> Any:
    async with http.post(f"{api_url}/responses", json={"model": MODEL, **body}) as reply:
        answer = await reply.json()
        assert reply.status == 200, answer
        return answer


async def test_a_response_chain_continues_on_the_other_edge_when_its_edge_is_killed(
    ha: Ha, faults: SimpleNamespace, report: Callable[[str], None]
) -> None:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        first = await respond(http, ha.edge_urls["edge"], {"input": "one"})
        await ha.stack.stop("edge", signal.SIGKILL)
        # Through the balancer: only edge-b is left to continue what the dead edge stored.
        second = await respond(
            http, ha.api_url, {"input": "two", "previous_response_id": first["id"]}
        )
        async with http.get(f"{ha.api_url}/responses/{second['id']}/input_items") as reply:
            assert reply.status == 200
            said = json.dumps((await reply.json())["data"])
        assert "one" in said  # the first turn, read from the chain the dead edge stored
        assert "two" in said
        await ha.stack.start("edge")
        await available_on_both(ha, faults)
        readable = {}
        for edge, url in ha.edge_urls.items():
            for response in (first, second):
                async with http.get(f"{url}/responses/{response['id']}") as reply:
                    readable[(edge, response["id"])] = reply.status
    report(f"a chain across an edge kill: stored responses read from either edge {readable}")
    assert set(readable.values()) == {200}


LINES = 40
ENDED = ("completed", "failed", "expired", "cancelled")


async def test_a_batch_completes_exactly_once_per_custom_id_across_an_edge_kill(
    ha: Ha, faults: SimpleNamespace, report: Callable[[str], None]
) -> None:
    # Made and watched through the edge that is then killed; read back through the balancer.
    first = AsyncOpenAI(base_url=ha.edge_urls["edge"], api_key="x", max_retries=0)
    async with first, AsyncOpenAI(base_url=ha.api_url, api_key="x", max_retries=5) as sdk:
        lines = [
            {
                "custom_id": f"ha-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": 1,
                    "iop_mock": {"delay_ms": 200},
                },
            }
            for i in range(LINES)
        ]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = await first.files.create(file=("batch.jsonl", data), purpose="batch")
        batch = await first.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(60):
            while True:
                got = await first.batches.retrieve(batch.id)
                done = got.request_counts.completed if got.request_counts else 0
                if done >= LINES // 4:
                    break
                await asyncio.sleep(0.05)
        await ha.stack.stop("edge", signal.SIGKILL)  # mid-batch: the worker's lease and lines
        async with asyncio.timeout(120):
            while (got := await sdk.batches.retrieve(batch.id)).status not in ENDED:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.2)
        assert got.output_file_id
        output = (await sdk.files.content(got.output_file_id)).text.splitlines()
        errors: list[str] = []
        if got.error_file_id:
            errors = (await sdk.files.content(got.error_file_id)).text.splitlines()
    ids = [json.loads(line)["custom_id"] for line in output + errors if line]
    counts = got.request_counts
    assert counts is not None
    report(
        f"batch across an edge kill: {got.status}, total {counts.total}, completed "
        f"{counts.completed}, failed {counts.failed}; output lines {len(output)}, error lines "
        f"{len(errors)}, distinct custom_ids {len(set(ids))} (done {done} at the kill)"
    )
    assert sorted(ids) == sorted(f"ha-{i}" for i in range(LINES))  # each exactly once
    assert got.status == "completed", (got.status, got.errors)
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
