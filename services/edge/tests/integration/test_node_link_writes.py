"""The edge's run requests on a real mTLS node link: those of one event-loop pass leave
in one write, and a cancel sent after them never overtakes them."""

from __future__ import annotations

import asyncio

import pytest

from iop_edge.adapters.node_server import NodeConnection
from iop_edge.domain.events import RunOrder
from iop_edge.domain.fleet import Operation
from iop_proto.connection import Connection
from iop_proto.testing import Pki, loopback_server, open_client
from iop_proto.v1 import runtime_pb2 as pb


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


class NodeSide:
    """What the node's end of the link received, in order, until the edge closed it."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str]] = []  # (body kind, run id)
        self.done = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="node", heartbeat_interval=0) as conn:
            async for envelope in conn:
                kind = envelope.WhichOneof("body")
                body = getattr(envelope, kind)
                self.received.append((kind, body.run_id))
        self.done.set()


def order(run_id: str) -> RunOrder:
    return RunOrder(
        run_id=run_id,
        model="m",
        provider_id="p",
        adapter="openai_api",
        target="served",
        operation=Operation.CHAT_COMPLETIONS,
        body_json=b'{"model":"served","messages":[]}',
        stream=True,
        deadline_unix_ms=0,
        include_usage=False,
    )


async def test_runs_of_one_pass_leave_in_one_write_and_a_cancel_after_them(pki: Pki) -> None:
    node = NodeSide()
    async with loopback_server(node.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        writes: list[int] = []
        write = writer.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            writes.append(len(data))
            write(data)

        writer.write = counted  # type: ignore[method-assign]
        conn = Connection(reader, writer, sender_id="edge", heartbeat_interval=0)
        link = NodeConnection("node-1", conn, "token", pb.NodeConfig(), acknowledges_runs=True)
        # Three dispatches in one pass (each its own task, as each request is).
        await asyncio.gather(*(link.send_run(order(f"r{n}")) for n in (1, 2, 3)))
        assert len(writes) == 1
        await link.send_run(order("r4"))
        await link.send_cancel("r4", "client gone")  # takes r4 along, first
        assert len(writes) == 2
        await conn.close()
        await asyncio.wait_for(node.done.wait(), 10)
    assert node.received == [
        ("run_request", "r1"),
        ("run_request", "r2"),
        ("run_request", "r3"),
        ("run_request", "r4"),
        ("cancel_request", "r4"),
    ]
