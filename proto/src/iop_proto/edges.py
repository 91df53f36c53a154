"""One link per edge: a node or a worker dials every edge of its fleet.

The settings name one edge or a few (``edge``, ``edges``): the seeds, dialled for as
long as the service runs. Each edge tells its peers which edges the control-plane
lists (``RegisterResponse.edges``: those linked to it now that said where their node
listener is), and ``EdgeLinks`` keeps one ``Dialer`` for each of them too:

- a listed edge no link reaches yet is dialled (a seed is recognised by its address
  before it registered, by the edge id it registered with after, so the edge a seed
  reaches is never dialled twice: a second registration of the same peer would replace
  the first at the edge, and the two would take turns);
- a link to an edge no longer listed is not dialled again, but the connection it has
  is kept until it ends: it proves the edge alive (its list was only late, e.g. a
  restarted control-plane that has not heard from every edge yet), and its runs end as
  they would have; listed again meanwhile, the link simply carries on;
- an empty list says nothing (an edge that knows of no edge): the links stay.

A link that is lost is dialled again with the dialer's own backoff, whichever kind
it is. The gauge given shows how many links are registered; ``registered`` is set
while one is at least.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from loguru import logger

from iop_proto.dialer import Dialer, DialSettings, EdgeAddress, LinkGauge
from iop_proto.v1 import runtime_pb2 as pb

L = TypeVar("L", bound=Dialer)
A = TypeVar("A", bound=EdgeAddress)
LinkFactory = Callable[[DialSettings, LinkGauge], L]
"""Makes one link: where it dials, and the gauge it shows its state on."""


def seed_edges(edge: A, edges: Sequence[A], edge_set: bool) -> tuple[A, ...]:
    """The edges a service dials from the start: ``edge`` (unless only ``edges`` was
    set: then ``edge`` is its default, not a choice) and ``edges``, each address once."""
    seeds: dict[tuple[str, int], A] = {}
    for address in ([edge] if edge_set or not edges else []) + list(edges):
        seeds.setdefault((address.host, address.port), address)
    return tuple(seeds.values())


class _LinkState:
    """One link's gauge: its 1 and 0 become the count of registered links."""

    def __init__(self, changed: Callable[[bool], None]) -> None:
        self._changed = changed
        self.up = False

    def set(self, value: float) -> None:
        up = bool(value)
        if up != self.up:
            self.up = up
            self._changed(up)


class EdgeLinks(Generic[L]):
    """The links of one service to the edges: the seeds and every edge listed.

    ``run`` dials until ``stop`` (and every link has ended) or until a seed's link fails
    for good (its edge's certificate does not fit: ``TlsMismatch``, raised here).
    """

    def __init__(
        self,
        seeds: Sequence[DialSettings],
        make: LinkFactory[L],
        gauge: LinkGauge,
        *,
        follow: bool = True,
    ) -> None:
        if not seeds:
            raise ValueError("at least one edge to dial")
        self._seed_dials = list(seeds)
        self._make = make
        self._gauge = gauge
        self._follow = follow
        self._seeds: list[L] = []
        self._listed: dict[str, L] = {}  # by edge id
        self._leaving: set[L] = set()  # no longer listed: their connection ends, no redial
        self._tasks: dict[L, asyncio.Task[None]] = {}
        self._states: dict[L, _LinkState] = {}
        self._listed_edges: dict[str, pb.EdgeEndpoint] = {}
        self._stopping = False
        self._done = asyncio.Event()
        self._fatal: BaseException | None = None
        self.registered = asyncio.Event()
        self.registrations = 0

    # ------------------------------------------------------------ state

    @property
    def links(self) -> list[L]:
        """Every link that runs now (seeds, listed, leaving)."""
        return list(self._tasks)

    @property
    def connected(self) -> int:
        return sum(state.up for state in self._states.values())

    def _link_changed(self, up: bool) -> None:
        if up:
            self.registrations += 1
        count = self.connected
        self._gauge.set(count)
        if count:
            self.registered.set()
        else:
            self.registered.clear()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        for dial in self._seed_dials:
            self._seeds.append(self._start(dial))
        try:
            await self._done.wait()
            if self._fatal is not None:
                raise self._fatal
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Dial no more; ``run`` returns once every link's connection has ended."""
        self._stopping = True
        for link in self._tasks:
            link.stop()
        if not self._tasks:
            self._done.set()

    def _start(self, dial: DialSettings) -> L:
        key = f"{dial.host}:{dial.port}"
        state = _LinkState(self._link_changed)
        link = self._make(dial, state)
        self._states[link] = state
        link.on_edges = self._heard
        task = asyncio.create_task(link.run(), name=f"edge-link:{key}")
        self._tasks[link] = task
        task.add_done_callback(lambda done: self._ended(link, key, done))
        return link

    def _ended(self, link: L, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(link, None)
        self._leaving.discard(link)
        for edge_id, listed in list(self._listed.items()):
            if listed is link:
                del self._listed[edge_id]
        state = self._states.pop(link, None)
        if state is not None and state.up:
            state.set(0)
        if not task.cancelled() and (failure := task.exception()) is not None:
            if link in self._seeds:
                self._fatal = failure
                self._done.set()
                return
            logger.opt(exception=failure).error("the link to the edge at {} failed", key)
        if self._stopping and not self._tasks:
            self._done.set()

    # ------------------------------------------------------------ the list

    def _heard(self, link: Dialer, edges: Sequence[pb.EdgeEndpoint]) -> None:
        if edges and self._follow:
            self._listed_edges = {edge.edge_id: edge for edge in edges if edge.edge_id}
        self._reconcile()

    def _reconcile(self) -> None:
        """Make the listed links match the list (seeds are never touched)."""
        if self._stopping or not self._follow:
            return
        seed_ids = {seed.edge_id for seed in self._seeds if seed.edge_id}
        seed_addresses = {(seed.dial.host, seed.dial.port) for seed in self._seeds}
        wanted = {
            edge_id: edge
            for edge_id, edge in self._listed_edges.items()
            if edge_id not in seed_ids and (edge.host, edge.port) not in seed_addresses
        }
        for edge_id, link in list(self._listed.items()):
            edge = wanted.get(edge_id)
            if edge is None or (link.dial.host, link.dial.port) != (edge.host, edge.port):
                del self._listed[edge_id]
                self._leaving.add(link)
                link.stop()  # its connection, if it has one, ends as it would have
                logger.info("edge {} is no longer listed: not dialling it again", edge_id)
        for edge_id, edge in wanted.items():
            if edge_id in self._listed:
                continue
            back = next(
                (
                    link
                    for link in self._leaving
                    if (link.dial.host, link.dial.port) == (edge.host, edge.port)
                    and not self._tasks[link].done()
                ),
                None,
            )
            if back is not None:
                self._leaving.discard(back)
                back.resume()
                self._listed[edge_id] = back
                continue
            dial = dataclasses.replace(
                self._seed_dials[0],
                host=edge.host,
                port=edge.port,
                server_name=edge.server_name or None,
                # only the operator can fix a certificate, and this edge is not ours to
                # stop for: its link keeps trying (the log says why it fails)
                fatal_tls_mismatch=False,
            )
            logger.info("edge {} listed at {}:{}: dialling it", edge_id, edge.host, edge.port)
            self._listed[edge_id] = self._start(dial)
