"""``EdgeLinks``: which edges a node or worker keeps a link to, driven by the lists it hears.

The links here are dialers that dial nothing: a test says when one registered (with
which edge id) and which list its edge sent, the way ``Dialer._register`` reports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from iop_proto.dialer import Dialer, DialSettings, LinkGauge
from iop_proto.edges import EdgeLinks, seed_edges
from iop_proto.tls_explain import TlsMismatch
from iop_proto.v1 import runtime_pb2 as pb

SEED = DialSettings(
    host="127.0.0.1",
    port=7000,
    server_name="localhost",
    sender_id="node-a",
    register_timeout_s=1,
    initial_delay_s=0.05,
    max_delay_s=0.1,
)


class FakeLink(Dialer):
    """A link whose registrations the test makes; ``run`` ends when stopped and its
    connection (if it has one) is closed by the test."""

    def __init__(self, dial: DialSettings, gauge: LinkGauge) -> None:
        super().__init__(dial, None, gauge)
        self.closed = asyncio.Event()
        self.fail_with: BaseException | None = None

    async def run(self) -> None:
        while True:
            if self.fail_with is not None:
                raise self.fail_with
            stopped = asyncio.ensure_future(self._stopping.wait())
            closed = asyncio.ensure_future(self.closed.wait())
            await asyncio.wait({stopped, closed}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            closed.cancel()
            if self.registered.is_set() and not self.closed.is_set():
                continue  # stopped while connected: the connection goes on
            if self._stopping.is_set():
                return
            self.closed.clear()  # a lost connection: "dial again"

    def registers(self, edge_id: str, edges: list[pb.EdgeEndpoint]) -> None:
        self.edge_id = edge_id
        self.registered.set()
        self._edge_connected.set(1)
        self._heard_edges(edges)

    def loses(self) -> None:
        self.registered.clear()
        self._edge_connected.set(0)
        self.closed.set()


class Gauge:
    value = 0.0

    def set(self, value: float) -> None:
        self.value = value


def endpoint(edge_id: str, port: int, host: str = "127.0.0.1") -> pb.EdgeEndpoint:
    return pb.EdgeEndpoint(edge_id=edge_id, host=host, port=port, server_name=edge_id)


@dataclasses.dataclass
class Running:
    links: EdgeLinks[FakeLink]
    gauge: Gauge
    task: asyncio.Task[None]

    def by_port(self, port: int) -> FakeLink | None:
        return next((link for link in self.links.links if link.dial.port == port), None)

    @property
    def seed(self) -> FakeLink:
        link = self.by_port(SEED.port)
        assert link is not None
        return link

    def ports(self) -> list[int]:
        return sorted(link.dial.port for link in self.links.links)


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    gauge = Gauge()
    links = EdgeLinks([SEED], FakeLink, gauge)
    task = asyncio.create_task(links.run())
    await asyncio.sleep(0)  # the seed's link starts
    yield Running(links, gauge, task)
    links.stop()
    for link in links.links:
        link.loses()
    await asyncio.wait_for(task, 5)


async def test_a_listed_edge_is_dialled_with_its_own_address_and_name(running: Running) -> None:
    running.seed.registers("edge-a", [endpoint("edge-a", 7000), endpoint("edge-b", 7001)])
    assert running.ports() == [7000, 7001]  # edge-a is the seed: not dialled twice
    listed = running.by_port(7001)
    assert listed is not None
    assert (listed.dial.server_name, listed.dial.sender_id) == ("edge-b", "node-a")
    assert not listed.dial.fatal_tls_mismatch  # a listed edge's certificate never stops us
    listed.registers("edge-b", [endpoint("edge-a", 7000), endpoint("edge-b", 7001)])
    assert running.gauge.value == 2
    assert running.links.registrations == 2
    listed.loses()
    assert running.gauge.value == 1
    assert running.links.registered.is_set()


async def test_the_seed_is_known_by_its_edge_id_at_another_address(running: Running) -> None:
    # edge-a advertises another name for itself than the seed's: its id tells it apart
    running.seed.registers("edge-a", [endpoint("edge-a", 7000, host="10.0.0.1")])
    assert running.ports() == [7000]


async def test_an_unlisted_edge_keeps_its_connection_and_is_resumed_when_listed_again(
    running: Running,
) -> None:
    both = [endpoint("edge-a", 7000), endpoint("edge-b", 7001)]
    running.seed.registers("edge-a", both)
    listed = running.by_port(7001)
    assert listed is not None
    listed.registers("edge-b", both)

    running.seed._heard_edges([endpoint("edge-a", 7000)])  # edge-b left the list
    assert listed.stopping
    assert running.by_port(7001) is listed  # still connected: kept
    running.seed._heard_edges(both)  # back before its connection ended
    assert not listed.stopping
    assert running.by_port(7001) is listed  # the same link, not a second one

    running.seed._heard_edges([endpoint("edge-a", 7000)])
    listed.loses()  # its connection ends: not dialled again
    async with asyncio.timeout(5):
        while running.ports() != [7000]:  # noqa: ASYNC110 - the link task's end, no event
            await asyncio.sleep(0.01)
    running.seed._heard_edges(both)  # listed again later: a new link
    again = running.by_port(7001)
    assert again is not None
    assert again is not listed


async def test_an_empty_list_changes_nothing(running: Running) -> None:
    running.seed.registers("edge-a", [endpoint("edge-a", 7000), endpoint("edge-b", 7001)])
    running.seed._heard_edges([])
    assert running.ports() == [7000, 7001]


async def test_not_following_keeps_to_the_seeds() -> None:
    links = EdgeLinks([SEED], FakeLink, Gauge(), follow=False)
    task = asyncio.create_task(links.run())
    await asyncio.sleep(0)
    [seed] = links.links
    seed.registers("edge-a", [endpoint("edge-a", 7000), endpoint("edge-b", 7001)])
    assert [link.dial.port for link in links.links] == [7000]
    links.stop()
    seed.loses()
    await asyncio.wait_for(task, 5)


async def test_a_seed_whose_certificate_does_not_fit_ends_the_run() -> None:
    def make(dial: DialSettings, gauge: LinkGauge) -> FakeLink:
        link = FakeLink(dial, gauge)
        link.fail_with = TlsMismatch("the edge's certificate is not valid for 127.0.0.1")
        return link

    with pytest.raises(TlsMismatch):
        await asyncio.wait_for(EdgeLinks([SEED], make, Gauge()).run(), 5)


def test_seeds_are_edge_and_edges_each_address_once() -> None:
    @dataclasses.dataclass(frozen=True)
    class Address:
        host: str
        port: int
        server_name: str | None = None

    default, b = Address("127.0.0.1", 7000), Address("10.0.0.2", 7000)
    assert seed_edges(default, [], edge_set=False) == (default,)
    assert seed_edges(default, [b], edge_set=False) == (b,)  # edge only defaulted
    assert seed_edges(default, [b, default], edge_set=True) == (default, b)
