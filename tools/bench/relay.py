"""A byte relay, one process: what one Python hop costs with no work in it (``floor.py``).

    relay.py --upstream HOST:PORT [--listen-tls DIR] [--upstream-tls DIR]

Listens on 127.0.0.1 (an ephemeral port, printed as ``relay on PORT``); for each
connection it accepts it opens one to the upstream and copies bytes both ways as
they come, parsing nothing. ``--listen-tls`` / ``--upstream-tls``: that side is
mutual TLS with the identity the IOP edge (listening) or node (dialling) uses, from
``DIR`` (``ca.pem``, ``edge.pem`` / ``edge.key``, ``node-a.pem`` / ``node-a.key``)
and IOP's own contexts (``iop_proto.tls``), so a TLS hop here costs what one of
IOP's does. On uvloop, as IOP's services run.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
from pathlib import Path
from typing import cast

import uvloop

from iop_proto.tls import TlsSettings, client_context, server_context


def identity(directory: Path, name: str) -> TlsSettings:
    """``name``'s certificate and key in ``directory``, with the CA beside them."""
    return TlsSettings(
        ca_file=directory / "ca.pem",
        cert_file=directory / f"{name}.pem",
        key_file=directory / f"{name}.key",
    )


class _Upstream(asyncio.Protocol):
    """The dialled side: what it receives goes down to the accepted connection."""

    def __init__(self, down: asyncio.Transport) -> None:
        self._down = down

    def data_received(self, data: bytes) -> None:
        self._down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._down.close()


class _Downstream(asyncio.Protocol):
    """An accepted connection: bytes that arrive before the upstream is open wait."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None) -> None:
        self._host, self._port, self._context = host, port, context
        self._up: asyncio.Transport | None = None
        self._early: list[bytes] = []
        self._dial: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._down = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._dial = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        server_hostname = "localhost" if self._context else None
        try:
            up, _ = await loop.create_connection(
                lambda: _Upstream(self._down),
                self._host,
                self._port,
                ssl=self._context,
                server_hostname=server_hostname,
            )
        except OSError:  # the client sees its connection close, not a silent hang
            self._down.close()
            return
        up.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for data in self._early:
            up.write(data)
        self._early.clear()
        self._up = up

    def data_received(self, data: bytes) -> None:
        if self._up is None:
            self._early.append(data)
        else:
            self._up.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._up is not None:
            self._up.close()
        elif self._dial is not None:
            self._dial.cancel()


async def serve(upstream: str, listen_tls: Path | None, upstream_tls: Path | None) -> None:
    host, _, port = upstream.rpartition(":")
    dial_context = client_context(identity(upstream_tls, "node-a")) if upstream_tls else None
    listen_context = server_context(identity(listen_tls, "edge")) if listen_tls else None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Downstream(host, int(port), dial_context),
        "127.0.0.1",
        0,
        ssl=listen_context,
    )
    print(f"relay on {server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Future()  # until SIGTERM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--listen-tls", type=Path, help="accept mutual TLS (the edge's identity)")
    parser.add_argument("--upstream-tls", type=Path, help="dial with mutual TLS (a node's)")
    args = parser.parse_args()
    uvloop.run(serve(args.upstream, args.listen_tls, args.upstream_tls))


if __name__ == "__main__":
    main()
