"""The node's link to an edge: dial, register, serve runs, report state, reconnect.

The node dials the edge (never the reverse) so nodes can sit behind NAT; the
dial, register and reconnect loop is ``iop_proto.dialer.Dialer``, the worker's
too. After any loss the link cancels the runs the edge can no longer receive
(the provider calls are aborted and their slots freed), and the loop waits a
jittered, growing delay and registers again.

A node keeps one such link per edge (``iop_proto.edges.EdgeLinks``: the edges of its
settings and those the edges list). They share the core: one capacity gate and FIFO
per provider whichever edge a run came from, so the node's queue is the order across
edges; each link's runs are its own (cancelled by its edge, or when it is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from loguru import logger

from iop_node.domain.events import Failed, Started
from iop_node.domain.runs import Completion, Delta
from iop_node.entrypoints import wire
from iop_node.errors import AnswerTooLarge, RunCancelled
from iop_node.runtime import ProviderRuntime
from iop_node.service.providers import NodeCore
from iop_node.settings import NodeSettings
from iop_proto.connection import Connection
from iop_proto.dialer import Dialer, DialSettings, LinkGauge
from iop_proto.errors import ConnectionClosed, FrameTooLarge, UnexpectedMessage
from iop_proto.v1 import runtime_pb2 as pb

ACK_HOLD_S = 0.02
"""How long a run's acknowledgement waits to leave with its first event (see
``ConnectionChannel``): a hundredth of the edge's default ``run_ack_timeout_s``."""
SNAPSHOT_MIN_GAP_S = 0.1  # coalesce bursts of changes into one snapshot (each costs both sides)
STOPPING = "the node is stopping"
EDGE_GONE = "the edge connection is gone"
"""Why every run of a lost connection ends: the run that finds out itself while sending
and the run the link cancels afterwards are recorded alike (``cancelled``, this reason)."""


class ConnectionChannel:
    """One run's events on the edge connection, numbered 0, 1, 2 ... without gaps.

    Fewer writes, same events: ``start`` waits for the run's next event and leaves
    in the same write (the edge has no use for it sooner, and a non-streamed run
    then costs one write, not two); deltas are deferred so those of one provider
    read leave together (``Connection.send(defer=True)``); the terminal event
    takes whatever waits along at once. ``accepted`` (event 0) is held for at most
    ``ACK_HOLD_S``: a run that sends anything before then takes it along in the same
    write (a fast run, streamed or not, costs one write and one wake-up of the edge
    fewer); a run still queued or waiting on its provider then sends it alone. The
    edge fails a run it does not hear of in time (``run_ack_timeout_s``, 2 s by
    default; any event acknowledges), so the hold must stay far below it.

    ``fold``: the edge reads a completion's start (``takes_folded_completions``), so a
    run that completes while its acknowledgement and start are still held sends one
    event, the completion with the start in it, instead of three: the edge decodes,
    checks and routes one event, not three, for every fast non-streamed run.
    Events are numbered as they leave, so the run's numbers have no gaps either way.

    ``runtime``: the run's provider, for an edge that reads a run's end's load
    (``takes_provider_load``): the terminal event carries the provider's load and cache
    account as they are once the run let go of its slot, which is all a snapshot would
    have told of the run. ``changed``: for an edge that does not, what asks for a
    snapshot as the run takes its slot and once its terminal event is sent (the
    snapshot path older edges read the load from).

    The adapter streams into the channel directly (``RunChannel``): the first delta
    carries the wait on the provider since ``started``, and ``first_token_ms`` notes
    when it left, for the run's history.
    """

    def __init__(
        self,
        conn: Connection,
        run_id: str,
        *,
        fold: bool = False,
        runtime: ProviderRuntime | None = None,
        changed: Callable[[], None] | None = None,
    ) -> None:
        self._conn = conn
        self._run_id = run_id
        self._fold = fold
        self._runtime = runtime
        self._changed = changed
        self._sequence = 0
        self._start: pb.RunEvent | None = None
        self._ack: pb.RunEvent | None = None
        self._ack_timer: asyncio.TimerHandle | None = None
        self._provider_began = 0.0  # perf_counter() at ``started``
        self.first_token_ms = 0

    async def _send(self, event: pb.RunEvent, *, defer: bool = False) -> None:
        """Send ``event`` after what is held for it (the acknowledgement, the start), each
        numbered as it leaves; a number is used only by an event that left."""
        conn, run_id = self._conn, self._run_id
        try:
            if self._ack is not None:
                ack, self._ack = self._ack, None
                if self._ack_timer is not None:
                    self._ack_timer.cancel()
                ack.run_id, ack.sequence = run_id, self._sequence
                await conn.send(ack, correlation_id=run_id, defer=True)
                self._sequence += 1
            if self._start is not None:
                start, self._start = self._start, None
                start.run_id, start.sequence = run_id, self._sequence
                await conn.send(start, correlation_id=run_id, defer=True)
                self._sequence += 1
            event.run_id, event.sequence = run_id, self._sequence
            try:
                await conn.send(event, correlation_id=run_id, defer=defer)
            except FrameTooLarge as exc:
                # Refused before a byte of it was written: the link is intact and the
                # number unused (the run's error takes it). The adapters hold answers
                # below the limit already; this keeps any that does not to its own run.
                raise AnswerTooLarge(exc.maximum) from exc
            self._sequence += 1
        except (ConnectionClosed, OSError) as exc:  # closed, or reset under the write
            raise RunCancelled(EDGE_GONE) from exc

    def accepted(self) -> None:
        """The node took the run: the edge hears of it with the run's first event, or
        after ``ACK_HOLD_S`` on its own (never blocks the receive loop)."""
        self._ack = pb.RunEvent(accepted={})
        self._ack_timer = asyncio.get_running_loop().call_later(ACK_HOLD_S, self._send_ack)

    def _send_ack(self) -> None:
        ack, self._ack = self._ack, None
        if ack is None:
            return
        ack.run_id, ack.sequence = self._run_id, self._sequence
        self._sequence += 1
        # a connection gone already: the run finds out itself when it sends
        with contextlib.suppress(ConnectionClosed, OSError):
            self._conn.send_soon(ack, correlation_id=self._run_id)

    def started(self, event: Started) -> None:
        self._start = wire.run_event(event)  # leaves with the run's next event
        self._provider_began = time.perf_counter()
        if self._changed is not None:
            self._changed()

    async def delta(self, delta: Delta) -> None:
        if not self.first_token_ms:
            self.first_token_ms = time.time_ns() // 1_000_000
            waited_us = int((time.perf_counter() - self._provider_began) * 1_000_000)
            delta = dataclasses.replace(delta, provider_us=waited_us)
        await self._send(wire.run_event(delta), defer=True)

    def _end_load(self) -> dict[str, Any] | None:
        """The provider's load and cache account as the run let go of its slot, for a run's
        end (``None``: an edge that does not read it, ``runtime`` not given)."""
        runtime = self._runtime
        if runtime is None:
            return None
        gate = runtime.gate
        return wire.provider_load(gate.in_flight, gate.queued, runtime.cache.view)

    async def completed(self, completion: Completion) -> None:
        event = wire.run_event(completion, self._end_load())
        if self._fold and self._ack is not None and self._start is not None:
            event.complete.start.CopyFrom(self._start.start)
            self._ack = self._start = None  # the completion acknowledges and starts it
            if self._ack_timer is not None:
                self._ack_timer.cancel()
        try:
            await self._send(event)
        finally:
            if self._changed is not None:
                self._changed()

    async def failed(self, failure: Failed) -> None:
        try:
            await self._send(wire.run_event(failure, self._end_load()))
        finally:
            if self._changed is not None:
                self._changed()


class Neighbours:
    """The node's live edge links, told of each other's runs.

    A run that takes or lets go of a slot changes what every edge must see of its
    provider: the edge that sent it reads the run's end's load (or asks for a snapshot),
    the others hear of it only in a snapshot, sent when this tells their link (coalesced
    like any change, ``SNAPSHOT_MIN_GAP_S``). With one edge it tells nobody.
    """

    def __init__(self) -> None:
        self._links: list[asyncio.Event] = []  # each live link's "send a snapshot"

    def join(self, dirty: asyncio.Event) -> None:
        self._links.append(dirty)

    def leave(self, dirty: asyncio.Event) -> None:
        with contextlib.suppress(ValueError):
            self._links.remove(dirty)

    def changed(self, but: asyncio.Event | None = None) -> None:
        for dirty in self._links:
            if dirty is not but:
                dirty.set()


class EdgeLink(Dialer):
    """Keeps the node registered with one edge for as long as it runs (``EdgeLinks``
    keeps one for each edge). Its runs are the core's runs of this link: its edge
    cancels only those, and losing it cancels only those."""

    def __init__(
        self,
        dial: DialSettings,
        settings: NodeSettings,
        core: NodeCore,
        tls: ssl.SSLContext | None,
        token: str,
        gauge: LinkGauge,
        version: str,
        neighbours: Neighbours | None = None,
    ) -> None:
        super().__init__(dial, tls, gauge)
        self._neighbours = neighbours or Neighbours()
        self._settings = settings
        self._core = core
        self._token = token
        self._version = version
        self._link = f"{dial.host}:{dial.port}"
        self._dirty = asyncio.Event()
        self._draining = False
        self._folds = False  # the edge takes folded completions (its registration says)
        self._loads = False  # the edge reads a run's end's load (its registration says)

    def _register_request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            peer_id=self._settings.service_id,
            token=self._token,
            version=self._version,
            role=pb.PEER_ROLE_NODE,
            providers=self._provider_states(),
            acknowledges_runs=True,
            follows_edges=self._settings.follow_edges,
        )

    async def _accepted(self, conn: Connection, response: pb.RegisterResponse) -> str:
        # this connection's edge: config updates later carry no capabilities
        self._folds = response.takes_folded_completions
        self._loads = response.takes_provider_load
        await self._apply(response.node_config)
        return f" ({len(response.node_config.providers)} providers)"

    async def _disconnected(self) -> None:
        if runs := self._core.runs_of(self._link):
            logger.warning("cancelling {} runs of the lost connection to {}", runs, self._link)
        await self._core.cancel_all(EDGE_GONE, link=self._link)

    async def _apply(self, config: pb.NodeConfig) -> None:
        await self._core.apply_config([wire.provider_config(p) for p in config.providers])

    async def _serve(self, conn: Connection) -> None:
        self._core.on_change(self._dirty.set)
        self._neighbours.join(self._dirty)
        snapshots = asyncio.create_task(self._send_snapshots(conn), name="snapshots")
        try:
            await self._receive(conn)
        finally:
            self._neighbours.leave(self._dirty)
            self._core.off_change(self._dirty.set)
            snapshots.cancel()
            await asyncio.gather(snapshots, return_exceptions=True)

    async def _receive(self, conn: Connection) -> None:
        while True:
            try:
                envelope = await conn.receive()
            except ConnectionClosed:
                return  # the edge closed the link: the dial loop takes over
            kind = envelope.WhichOneof("body")
            if kind == "run_request":
                request = envelope.run_request
                if self._loads:
                    # this edge reads the run's end's load; the others learn of the slot
                    # in a snapshot
                    runtime = self._core.providers.get(request.provider_id)
                    channel = ConnectionChannel(
                        conn,
                        request.run_id,
                        fold=self._folds,
                        runtime=runtime,
                        changed=functools.partial(self._neighbours.changed, self._dirty),
                    )
                else:
                    channel = ConnectionChannel(
                        conn, request.run_id, fold=self._folds, changed=self._neighbours.changed
                    )
                if self._core.start_run(wire.run_order(request), channel, self._link):
                    channel.accepted()
            elif kind == "cancel_request":
                cancel = envelope.cancel_request
                why = cancel.reason or "no reason given"
                self._core.cancel(cancel.run_id, f"cancelled by the edge: {why}", self._link)
            elif kind == "register_response":
                # the edge pushes config changes (and the list of edges) the same way it
                # answered the registration
                await self._apply(envelope.register_response.node_config)
                self._heard_edges(envelope.register_response.edges)
            elif kind == "error":
                logger.warning("edge reported: {}", envelope.error.message)
            else:
                raise UnexpectedMessage(f"a node does not accept {kind} from the edge")

    async def _send_snapshots(self, conn: Connection) -> None:
        """On every change (coalesced) and every ``snapshot_interval_s`` anyway.

        A change is what the runs do not carry: health, served models, config, the
        drain; and, for an edge that does not read a run's end's load, each run's end.
        The periodic one brings the node's queue and the cache account to the edge
        also when nothing ended (a run still queued, a run whose end the edge dropped).
        """
        self._dirty.set()
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancel that comes
            # as the wait ends (the drain's change wakes this loop just as the link closes).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.snapshot_interval_s):
                    await self._dirty.wait()
            self._dirty.clear()
            snapshot = pb.ProviderSnapshot(
                node_id=self._settings.service_id, providers=self._provider_states()
            )
            try:
                await conn.send(snapshot)
            except ConnectionClosed:
                return  # the receive loop sees the end too
            await asyncio.sleep(SNAPSHOT_MIN_GAP_S)

    def _provider_states(self) -> list[pb.ProviderState]:
        states = [wire.provider_state(s) for s in self._core.states()]
        if self._draining:
            for state in states:
                state.health = pb.HEALTH_UNAVAILABLE
                state.detail = STOPPING
        return states

    def begin_drain(self) -> None:
        """The node is stopping: this edge is told to send no more runs.

        Every provider is reported unavailable at once (the next snapshot, within
        ``SNAPSHOT_MIN_GAP_S``), so the edge routes new requests elsewhere; runs that
        arrive before it has heard are served like the others (``drain``).
        """
        self._draining = True
        self._dirty.set()


async def drain(links: Sequence[EdgeLink], core: NodeCore, timeout_s: float) -> None:
    """The node is stopping: every edge is told to send no more runs, those in flight
    finish. Whatever still runs after ``timeout_s`` is cancelled when its link closes,
    each with its error."""
    for link in links:
        link.begin_drain()
    if core.runs_in_flight:
        logger.info(
            "stopping: waiting up to {:.0f}s for {} runs in flight",
            timeout_s,
            core.runs_in_flight,
        )
    left = await core.wait_for_runs(timeout_s)
    if left:
        logger.warning("stopping: {} runs did not finish in time and are cancelled", left)
