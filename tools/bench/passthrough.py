"""IOP's two hops built from IOP's libraries with none of IOP's work: ``floor.py``'s
``libs2_mtls`` target.

    passthrough.py --role edge --tls DIR
    passthrough.py --role node --upstream HOST:LINK_PORT --provider URL --tls DIR

The ``edge`` role is an aiohttp web server (as IOP's edge) that also accepts one
mutual-TLS link, which the ``node`` role dials (as IOP's node dials its edge). Every
POST body the edge gets goes, with a request number, as one length-prefixed frame
over the link; the node posts it with an aiohttp client session (as IOP's node
adapter does) to ``URL`` plus the request's path, in a task of its own, and sends the
answer back the same way; the edge answers with it. Each side on uvloop, with IOP's TLS
contexts and identities from ``DIR`` (``ca.pem``, ``edge.*``, ``node-a.*``). No
routing, no protobuf, no queue, no history, no metrics: what the libraries and the
shape cost, so that ``floor.py`` can tell that from what IOP's own code costs. Ready
lines: ``passthrough on HTTP_PORT link LINK_PORT`` (the edge), ``passthrough linked``
(the node).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import struct
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web
from relay import identity  # this script's folder is first on sys.path

from iop_proto.tls import client_context, server_context

HEADER = struct.Struct("!II")  # request number, payload length
JSON = "application/json"
FAILED = b""  # the node's answer when the provider gave no 200


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    number, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    return number, await reader.readexactly(length)


def _frame(number: int, payload: bytes) -> bytes:
    return HEADER.pack(number, len(payload)) + payload


async def edge(tls: Path) -> None:
    """HTTP in, frames out over the one node link it accepts (as IOP's edge listens)."""
    linked: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    linked = asyncio.get_running_loop().create_future()
    waiting: dict[int, asyncio.Future[bytes]] = {}
    numbers = itertools.count()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        linked.set_result((reader, writer))
        try:
            while True:
                number, payload = await _read_frame(reader)
                waiting.pop(number).set_result(payload)
        except (asyncio.IncompleteReadError, OSError):  # the node is gone: fail what waits
            for answer in waiting.values():
                answer.set_result(FAILED)

    async def forward(request: web.Request) -> web.Response:
        _, writer = await linked
        number = next(numbers)
        answer = waiting[number] = asyncio.get_running_loop().create_future()
        writer.write(_frame(number, request.path.encode() + b"\n" + await request.read()))
        body = await answer
        if body == FAILED:
            return web.Response(status=502, text="the node could not reach the provider")
        return web.Response(body=body, content_type=JSON)

    context = server_context(identity(tls, "edge"))
    link = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=context)
    app = web.Application()
    app.router.add_post("/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = runner.addresses[0][1]
    link_port = link.sockets[0].getsockname()[1]
    print(f"passthrough on {http_port} link {link_port}", flush=True)
    await asyncio.Future()  # until SIGTERM


async def node(upstream: str, provider: str, tls: Path) -> None:
    """Dials the edge (as IOP's node does) and posts each frame to the provider."""
    host, _, port = upstream.rpartition(":")
    context = client_context(identity(tls, "node-a"))
    reader, writer = await asyncio.open_connection(
        host, int(port), ssl=context, server_hostname="localhost"
    )
    http = aiohttp.ClientSession()
    tasks: set[asyncio.Task[None]] = set()

    async def post(number: int, payload: bytes) -> None:
        path, _, body = payload.partition(b"\n")
        headers = {"Content-Type": JSON}
        answer = FAILED  # a failure is answered (the edge sends a 502), never left hanging
        try:
            async with http.post(provider + path.decode(), data=body, headers=headers) as response:
                if response.status == 200:
                    answer = await response.read()
        except (aiohttp.ClientError, OSError):
            pass
        writer.write(_frame(number, answer))

    print("passthrough linked", flush=True)
    while True:
        number, payload = await _read_frame(reader)
        task = asyncio.create_task(post(number, payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("edge", "node"), required=True)
    parser.add_argument("--upstream", help="the node role: the edge role's link HOST:PORT")
    parser.add_argument("--provider", help="the node role: the provider's base URL")
    parser.add_argument("--tls", type=Path, required=True, help="ca.pem, edge.*, node-a.*")
    args = parser.parse_args()
    if args.role == "edge":
        uvloop.run(edge(args.tls))
    else:
        uvloop.run(node(args.upstream, args.provider, args.tls))


if __name__ == "__main__":
    main()
