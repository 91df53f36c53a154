"""A key's weight and priority, on a real stack (issue 32): two keys weighted 3 and 1
that both flood a model are served 3:1; a key with a higher priority goes first.

The control-plane's CLI does not set a key's weight or priority here, so they reach
the edge the way every key's policy does, in the fleet config, written on its way: a
relay with the control-plane's certificate, between the edge and the real
control-plane (real mTLS both ways), sets ``weight`` and ``priority`` on the keys it
names in each ``FleetConfig`` and passes every other frame as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from iop_proto.errors import ConnectionClosed
from iop_proto.framing import read_frame, write_frame
from iop_proto.tls import client_context, server_context

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "hardening"))
import fair_sharing

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
POLICIES = {"heavy": (3, 0), "light": (1, 0), "urgent": (1, 5)}  # name: (weight, priority)


class PolicyRelay:
    """Between the edge and the control-plane: sets ``POLICIES`` on the fleet configs."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        context = server_context(self._stack.tls("control-plane"))
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1",
            self._stack.cp_port,
            ssl=client_context(self._stack.tls("edge")),
            server_hostname="localhost",
        )
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, rewrite=False)),
            asyncio.create_task(self._pump(up_reader, writer, rewrite=True)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for w in (writer, up_writer):
            w.close()

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, rewrite: bool
    ) -> None:
        with contextlib.suppress(ConnectionClosed, ConnectionError, OSError):
            while True:
                envelope = await read_frame(reader)
                if rewrite and envelope.WhichOneof("body") == "fleet_config":
                    for key in envelope.fleet_config.api_keys:
                        if key.name in POLICIES:
                            key.weight, key.priority = POLICIES[key.name]
                await write_frame(writer, envelope)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def relayed(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[tuple[Stack, dict[str, str]]]:
    async with start_stack_factory(tmp_path_factory.mktemp("weights"), fair_sharing.FLEET) as stack:
        relay = PolicyRelay(stack)
        port = await relay.start()
        try:
            await stack.stop("edge")
            path = stack.root / "edge.yaml"
            settings = yaml.safe_load(path.read_text())
            settings["control_plane"]["port"] = port
            path.write_text(yaml.safe_dump(settings))
            edge = await stack.start("edge")  # on its pinned ports: the nodes dial back
            stack.edge_admin = edge.admin_url  # the admin port is a new one
            await stack.wait_registered(("node-a", "node-b", "worker"), timeout_s=30)
            keys = {name: await stack.issue_key(name) for name in POLICIES}
            yield stack, keys
        finally:
            await relay.close()


async def test_keys_weighted_3_and_1_that_both_flood_are_served_3_to_1(
    relayed: tuple[Stack, dict[str, str]],
) -> None:
    stack, keys = relayed
    async with fair_sharing.session() as http:
        tasks: dict[asyncio.Task[tuple[int, float]], str] = {}
        for i in range(120):  # sent interleaved: today's FIFO serves them 1:1
            for name in ("heavy", "light"):
                payload = fair_sharing.body("fair", f"{name}-{i}", max_tokens=1)
                task = asyncio.create_task(fair_sharing.ask(http, stack, keys[name], payload))
                tasks[task] = name

        async def all_arrived() -> bool:
            held = await fair_sharing.queued(http, stack, "fair")
            return held + sum(t.done() for t in tasks) + 1 >= len(tasks)

        await fair_sharing.until(all_arrived)
        since = time.monotonic()
        await asyncio.gather(*tasks)
    answered = sorted((t.result()[1], name) for t, name in tasks.items() if t.result()[1] > since)
    window = [name for _, name in answered[:80]]  # while both keys still wait
    heavy, light = window.count("heavy"), window.count("light")
    assert {t.result()[0] for t in tasks} == {200}
    assert 2.0 <= heavy / max(light, 1) <= 4.5, (heavy, light)


async def test_a_key_with_a_higher_priority_goes_before_a_burst(
    relayed: tuple[Stack, dict[str, str]],
) -> None:
    stack, keys = relayed
    async with fair_sharing.session() as http:
        burst = await fair_sharing.flood(http, stack, keys["light"], 100, waves=1)
        sent_at = time.monotonic()
        payload = fair_sharing.body("fair", "urgent", max_tokens=1)
        status, answered_at = await fair_sharing.ask(http, stack, keys["urgent"], payload)
        served = burst.served_between(sent_at, answered_at)
        await asyncio.gather(*burst.tasks)
    assert status == 200
    assert served <= 2, served  # the one running, and one answer read late at most
