"""``ResponsesWebSocket`` over the real run pipeline (``InferenceRoutes``), served on
127.0.0.1 and driven by aiohttp's WebSocket client, over small fakes: a run that streams
one token and then waits, so what the socket does to a run in flight is seen exactly
(its cancel, the key's slot), and the socket's own limits (idle time, message size,
shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import WSCloseCode, web
from prometheus_client import CollectorRegistry

from iop_edge.domain.events import Delta, Failed, RunEvent, Started
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry
from iop_edge.entrypoints.api_auth import KeySlots
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.inference_routes import InferenceRoutes
from iop_edge.entrypoints.responses_websocket import RecentResponses, ResponsesWebSocket
from iop_edge.errors import EdgeError, from_failure
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.ports import AttemptRecord, EdgeRunRecord, RunSpec
from iop_edge.service.key_rates import KeyRates
from iop_edge.service.memory_key_rates import MemoryKeyRates
from iop_edge.testing import MemoryResponseStore, one_at_a_time
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.testing import loopback_app

MODEL = "m"
KEY = ApiKeyEntry("k1", "tester", "hash", frozenset(), max_concurrent=1)


class Run:
    """Streams one token, then waits until cancelled."""

    def __init__(self) -> None:
        self.run_id = "run1"
        self.provider_id = "p1"
        self.node_id = "n1"
        self.target = "served"
        self.node_wait_ms = 0
        self.cancelled: list[str] = []
        self.stopped = asyncio.Event()

    async def _iterate(self) -> AsyncIterator[RunEvent]:
        yield Started("p1")
        yield Delta(text="one", role="assistant")
        await self.stopped.wait()

    _reading: AsyncIterator[RunEvent] | None = None

    async def next_events(self) -> tuple[RunEvent, ...]:
        if self._reading is None:
            self._reading = self._iterate()
        return await one_at_a_time(self._reading)

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        self.cancelled.append(reason)
        self.stopped.set()

    async def open(self) -> None:
        """Dispatched at once: no queue."""

    @property
    def ended(self) -> bool:
        return bool(self.cancelled)

    def error(self, failed: Failed) -> EdgeError:
        return from_failure(failed)

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        return (AttemptRecord(self.run_id, self.provider_id, self.node_id, "cancelled"),)


@dataclass
class Service:
    runs: list[Run] = field(default_factory=list)

    def admit(self, spec: RunSpec) -> Run:
        self.runs.append(Run())
        return self.runs[-1]


class Catalog:
    def model(self, model_id: str) -> ModelEntry | None:
        return ModelEntry(MODEL, MODEL, {"p1": "served"}) if model_id == MODEL else None


class Keys:
    configured = True  # a fleet config has arrived
    open = False

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return KEY if presented_key == "sk-good" else None


@dataclass
class RunLog:
    records: list[EdgeRunRecord] = field(default_factory=list)
    written: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, record: EdgeRunRecord) -> None:
        self.records.append(record)
        self.written.set()

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        return self.records[-limit:]


@dataclass
class Edge:
    url: str
    service: Service
    slots: KeySlots
    runlog: RunLog
    sockets: ResponsesWebSocket
    app: web.Application


@contextlib.asynccontextmanager
async def serve(
    idle_timeout_s: float = 60.0, store: MemoryResponseStore | None = None
) -> AsyncIterator[Edge]:
    service, slots, runlog = Service(), KeySlots(), RunLog()
    metrics = ApiMetrics.create(CollectorRegistry())
    rates = KeyRates(MemoryKeyRates())
    inference = InferenceRoutes(service, Catalog(), Keys(), runlog, metrics, slots, rates)  # type: ignore[arg-type]
    store = MemoryResponseStore() if store is None else store
    sockets = ResponsesWebSocket(
        inference, store, ReasoningSeal.generate(), Keys(), 1024, idle_timeout_s
    )
    app = web.Application()
    app.router.add_get("/v1/responses", sockets.serve)
    async with loopback_app(app, cancel_handlers=True) as port:
        yield Edge(f"http://127.0.0.1:{port}/v1/responses", service, slots, runlog, sockets, app)


HEADERS = {"Authorization": "Bearer sk-good"}


async def test_closing_the_socket_cancels_the_run_and_frees_the_key_s_slot() -> None:
    async with serve() as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        await ws.send_json({"type": "response.create", "model": MODEL, "input": "x"})
        kinds = []
        while "response.output_text.delta" not in kinds:
            kinds.append((await ws.receive_json())["type"])
        assert edge.slots.held("k1") == 1
        await ws.close()
        async with asyncio.timeout(5):
            await edge.runlog.written.wait()  # once the run's handling has ended
        (run,) = edge.service.runs
        assert run.cancelled == ["client disconnected"]
        assert edge.slots.held("k1") == 0
        assert edge.runlog.records[0].outcome == "cancelled"


async def test_a_key_s_concurrency_limit_holds_across_sockets() -> None:
    async with serve() as edge, aiohttp.ClientSession() as http:
        first = await http.ws_connect(edge.url, headers=HEADERS)
        await first.send_json({"type": "response.create", "model": MODEL, "input": "x"})
        assert (await first.receive_json())["type"] == "response.created"
        second = await http.ws_connect(edge.url, headers=HEADERS)
        await second.send_json({"type": "response.create", "model": MODEL, "input": "y"})
        error = await second.receive_json()
        assert (error["type"], error["status"]) == ("error", 429)
        await first.close()
        await second.close()


async def test_an_idle_socket_is_closed() -> None:
    async with serve(idle_timeout_s=0.2) as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        message = await ws.receive(timeout=5)
        assert message.type is aiohttp.WSMsgType.CLOSE
        assert message.data == WSCloseCode.OK
        assert message.extra == "idle timeout"


async def test_a_socket_running_a_response_is_not_idle() -> None:
    async with serve(idle_timeout_s=0.2) as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        await ws.send_json({"type": "response.create", "model": MODEL, "input": "x"})
        async with asyncio.timeout(5):
            while (await ws.receive_json())["type"] != "response.output_text.delta":
                pass
        with contextlib.suppress(TimeoutError):
            message = await ws.receive(timeout=0.6)  # three idle periods, the run going on
            raise AssertionError(f"the socket said {message} while its response ran")
        assert not ws.closed
        await ws.close()


async def test_a_message_over_the_body_limit_closes_the_socket_with_1009() -> None:
    async with serve() as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        await ws.send_json({"type": "response.create", "model": MODEL, "input": "x" * 2048})
        message = await ws.receive(timeout=5)
        assert message.type is aiohttp.WSMsgType.CLOSE
        assert message.data == WSCloseCode.MESSAGE_TOO_BIG
        assert edge.service.runs == []


async def test_shutdown_closes_the_sockets_left_with_1001() -> None:
    async with serve() as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        await edge.sockets.close_all(edge.app)
        message = await ws.receive(timeout=5)
        assert message.type is aiohttp.WSMsgType.CLOSE
        assert message.data == WSCloseCode.GOING_AWAY


class DownStore(MemoryResponseStore):
    """The shared store known to be down: ``admit`` refuses as PostgreSQL's store does."""

    def admit(self, key_id: str, incoming: int) -> None:
        raise StoreDown("storing responses: the PostgreSQL store is unreachable")


async def test_the_store_down_is_a_retryable_error_event_and_the_socket_goes_on() -> None:
    async with serve(store=DownStore()) as edge, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(edge.url, headers=HEADERS)
        await ws.send_json({"type": "response.create", "model": MODEL, "input": "x"})
        error = await ws.receive_json(timeout=5)
        assert (error["type"], error["status"], error["code"]) == (
            "error",
            503,
            "storage_unavailable",
        )
        assert edge.service.runs == []  # refused before it ran
        await ws.send_json(
            {"type": "response.create", "model": MODEL, "input": "y", "store": False}
        )
        assert (await ws.receive_json(timeout=5))["type"] == "response.created"
        await ws.close()


def test_a_connection_keeps_its_last_responses_only() -> None:
    recent = RecentResponses(limit=2)
    for n in range(3):
        output = [{"type": "message", "role": "assistant", "content": f"a{n}"}]
        recent.remember({"id": f"r{n}", "output": output}, [{"role": "user", "content": f"q{n}"}])
    assert recent.conversation("r0") is None
    assert recent.conversation("r2") == [
        {"role": "user", "content": "q2"},
        {"type": "message", "role": "assistant", "content": "a2"},
    ]
    recent.remember({"id": "r1", "status": "failed"}, [])
    assert recent.conversation("r1") is None
