"""Test support shared by every service's tests: throwaway CAs and loopback servers.

Shipped in the contract package (like ``aiohttp.test_utils``) because every
service tests its IOP links the same way. ``trustme`` is a development
dependency, imported only when a CA is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from iop_proto.tls import TlsSettings, client_context, server_context

if TYPE_CHECKING:
    import trustme


def write_identity(ca: trustme.CA, directory: Path, name: str, role: str) -> TlsSettings:
    """Issue ``name`` (CN) with ``role`` (OU) from ``ca`` and return settings pointing at it."""
    directory.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert("127.0.0.1", "localhost", common_name=name, organization_unit_name=role)
    ca_file = directory / "ca.pem"
    cert_file = directory / f"{name}.pem"
    key_file = directory / f"{name}.key"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return TlsSettings(ca_file=ca_file, cert_file=cert_file, key_file=key_file)


@dataclass(frozen=True)
class Pki:
    """One fleet CA with an edge (server) and a node (client) identity."""

    ca: trustme.CA
    edge: TlsSettings
    node: TlsSettings

    @classmethod
    def create(cls, directory: Path) -> Pki:
        import trustme

        ca = trustme.CA()
        return cls(
            ca=ca,
            edge=write_identity(ca, directory, "edge", "edge"),
            node=write_identity(ca, directory, "node-a", "node"),
        )

    def server(self) -> ssl.SSLContext:
        return server_context(self.edge)

    def client(self) -> ssl.SSLContext:
        return client_context(self.node)


LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections, for as long as the block runs.

    Bound but never listening: a connection attempt is refused at once, and, unlike a
    port that was free a moment ago, no other process can start listening on it meanwhile.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        yield int(sock.getsockname()[1])


class PortTaken(Exception):
    """A program was given a port and could not bind it: someone else took it first."""


def port_taken(port: int) -> bool:
    """Whether something now holds ``port`` on loopback (so a failed start lost the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def ports_to_try(attempts: int = 5) -> Iterator[int]:
    """Loopback ports, one per start attempt, for a program that must be told its port
    before it starts and cannot bind port 0 and report what it got (llama.cpp, docker
    compose, LiteLLM). Our own services bind 0 and name their ports in ``ready:`` and
    ``/readyz``: use that for them, never this.

    Each port was free when handed out, but another process may bind it before the
    program does (the kernel is free to give it out again once we let go). So the
    caller starts the program on the port, raises ``PortTaken`` when the start fails
    and ``port_taken(port)`` says why, and goes on to the next port::

        for port in ports_to_try():
            try:
                server = await start(port)
            except PortTaken:
                continue
            break

    After ``attempts`` lost races the iterator raises ``PortTaken`` itself.
    """
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
        yield port
    raise PortTaken(f"{attempts} ports in a row were taken before the program could bind them")


def port_offsets(
    ports: Collection[int], attempts: int = 5, low: int = 20000, high: int = 32000
) -> Iterator[int]:
    """``ports_to_try`` for a program started on a fixed set of ``ports`` moved by one
    offset (``make run``'s ``--port-offset``): offsets that put every one of them
    between ``low`` and ``high`` (below the kernel's ephemeral range) and on a port
    free right now. The same race, so the same use: start, and when the start failed
    and ``port_taken`` says one of the moved ports is held, take the next offset.
    """
    rng = random.Random()
    for _ in range(attempts):
        for _ in range(200):
            offset = rng.randrange(low - min(ports), high - max(ports))
            if not any(port_taken(port + offset) for port in ports):
                yield offset
                break
        else:
            raise PortTaken(f"no free block of {len(ports)} ports between {low} and {high}")
    raise PortTaken(f"{attempts} blocks of ports in a row were taken before the program bound them")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def loopback_server(handler: Handler, context: ssl.SSLContext | None) -> AsyncIterator[int]:
    """Serve ``handler`` on 127.0.0.1 (ephemeral port); yields the port.

    Handler tasks are owned here and cancelled on exit so no test leaks one.
    """
    tasks: set[asyncio.Task[None]] = set()

    async def owned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        finally:
            tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(owned, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def loopback_app(
    app: web.Application, *, cancel_handlers: bool = False
) -> AsyncIterator[int]:
    """Serve an aiohttp ``app`` on 127.0.0.1 (ephemeral port); yields the port.

    The fake upstreams and API apps of the tests, served one way: bound to port 0 and
    read back, no access log, cleaned up on exit. ``cancel_handlers``: a handler is
    cancelled when its client leaves, as the edge's own runner is set up.
    """
    runner = web.AppRunner(app, handler_cancellation=cancel_handlers, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def open_client(
    port: int, context: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost" if context else None
    )


@dataclass
class RunningService:
    """A service started as a real process by ``running_service``."""

    process: asyncio.subprocess.Process
    admin_url: str
    log: list[str]
    ports: dict[str, int] = field(default_factory=dict)  # bound listeners, from ``ready:``
    _grew: asyncio.Condition = field(default_factory=asyncio.Condition)
    _done: bool = False  # the log stream ended

    async def wait_for_line(self, text: str) -> str:
        """The first log line containing ``text``, waiting for it to be written."""
        async with self._grew:
            while True:
                for line in self.log:
                    if text in line:
                        return line
                if self.process.returncode is not None and self._done:
                    raise AssertionError(f"the service exited without logging {text!r}")
                await self._grew.wait()

    async def _record(self, stream: asyncio.StreamReader) -> None:
        while raw := await stream.readline():
            async with self._grew:
                self.log.append(raw.decode(errors="replace"))
                self._grew.notify_all()
        async with self._grew:
            self._done = True
            self._grew.notify_all()


_READY = re.compile(r"ready: \S+ admin (http://\S+)(?: ports (\{.*?\}))?")


async def _read_until_ready(
    process: asyncio.subprocess.Process, log: list[str]
) -> tuple[str, dict[str, int]]:
    assert process.stderr is not None
    while True:
        raw = await process.stderr.readline()
        if not raw:
            raise RuntimeError("service exited before it was ready:\n" + "".join(log))
        line = raw.decode(errors="replace")
        log.append(line)
        match = _READY.search(line)
        if match:
            return match.group(1), json.loads(match.group(2) or "{}")


@contextlib.asynccontextmanager
async def running_service(
    script: str,
    config: Path,
    env: dict[str, str] | None = None,
    ready_timeout: float = 30.0,
    wrapper: Sequence[str] = (),
) -> AsyncIterator[RunningService]:
    """Start ``script --config config`` and wait for its ``ready:`` log line.

    ``wrapper``: a command that execs the service (``ip netns exec NAME``), so the
    process started is still the service's own: signals reach it.

    The readiness line is the explicit signal: it names the admin URL and the bound
    listening ports (``RunningService.ports``), so every port may be 0. The process
    is killed on exit if the test did not stop it.
    """
    bin_dir = Path(sys.executable).parent
    process = await asyncio.create_subprocess_exec(
        *wrapper,
        str(bin_dir / script),
        "--config",
        str(config),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    log: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        ready = _read_until_ready(process, log)
        admin_url, ports = await asyncio.wait_for(ready, ready_timeout)
        assert process.stderr is not None
        service = RunningService(process=process, admin_url=admin_url, log=log, ports=ports)
        drain = asyncio.create_task(service._record(process.stderr))
        yield service
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        if drain is not None:
            await drain


async def stop_service(service: RunningService, signal_number: int = signal.SIGTERM) -> int:
    """Signal the service and wait for it to exit; returns its exit code."""
    service.process.send_signal(signal_number)
    return await asyncio.wait_for(service.process.wait(), 30)
