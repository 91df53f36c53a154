"""A small TCP load balancer: the one in front of several edges in ``make run HA=1`` and the
fault tests (deployments put HAProxy there; docker-compose.yml's ``ha`` profile does).

Why not HAProxy here too: ``make run`` works on a fresh machine with Python and make, and
the fault tests run wherever the suite runs; neither may need root and a system package.
What the edges need from a balancer is only what any layer-4 one gives: each client
connection goes to one backend, round robin; a backend that refuses the connection (an
edge that died) is skipped for the next one, so a new request never lands on a dead edge
while another answers; a backend that fails is rested for ``--rest`` seconds before it is
tried first again. A connection already carried by an edge that dies is cut, as HAProxy
would cut it: its client sees the connection end, a clear error, never a hang.

    python tools/tcp_balancer.py --listen 127.0.0.1:8080 \\
        --backend 127.0.0.1:8081 --backend 127.0.0.1:8082

Prints ``ready: balancer http://HOST:PORT`` once it accepts (port 0: the one it got).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

CHUNK = 64 * 1024


@dataclass
class Backend:
    host: str
    port: int
    rested_until: float = 0.0  # monotonic time before which it is tried only as a last resort

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Balancer:
    backends: list[Backend]
    connect_timeout_s: float = 2.0
    rest_s: float = 2.0
    _next: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def order(self) -> list[Backend]:
        """Round robin from the next backend, rested ones last (still tried: when every
        backend failed lately, trying them is better than refusing outright)."""
        start, self._next = self._next, (self._next + 1) % len(self.backends)
        rotated = self.backends[start:] + self.backends[:start]
        now = time.monotonic()
        return sorted(rotated, key=lambda b: b.rested_until > now)  # stable: keeps the turn

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for backend in self.order():
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    return await asyncio.open_connection(backend.host, backend.port)
            except (OSError, TimeoutError) as exc:
                backend.rested_until = time.monotonic() + self.rest_s
                print(f"backend {backend} failed ({exc!r}); trying the next", flush=True)
        return None

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(client_w)
        try:
            upstream = await self.connect()
            if upstream is None:
                print("no backend accepted the connection; closing it", flush=True)
                return
            up_r, up_w = upstream
            self._writers.add(up_w)
            try:
                await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))
            finally:
                self._writers.discard(up_w)
                await close(up_w)
        finally:
            self._writers.discard(client_w)
            await close(client_w)
            self._tasks.discard(task)

    async def serve(self, host: str, port: int, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self.handle, host, port, reuse_address=True)
        bound = server.sockets[0].getsockname()[1]
        names = ", ".join(str(b) for b in self.backends)
        print(f"balancing over {names}", flush=True)
        print(f"ready: balancer http://{host}:{bound}", flush=True)
        async with server:
            await stop.wait()
            server.close()
            # Cut what is carried (clients see their connection end), and let each
            # connection's task end by itself: asyncio's server logs a cancelled one.
            for writer in list(self._writers):
                writer.transport.abort()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the half-close on; a reset ends both ways."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()  # the other side learns of it at once, as with a reset


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tcp_balancer", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=address, required=True, help="HOST:PORT (port 0: any)")
    parser.add_argument("--backend", type=address, action="append", required=True)
    parser.add_argument("--connect-timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--rest", type=float, default=2.0, help="seconds a failed backend rests")
    args = parser.parse_args(argv)
    balancer = Balancer(
        [Backend(host, port) for host, port in args.backend],
        connect_timeout_s=args.connect_timeout,
        rest_s=args.rest,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        host, port = args.listen
        await balancer.serve(host, port, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
