"""A burst of concurrent requests at an edge's public port, from a process of its own.

    python tools/hardening/flood.py --url http://127.0.0.1:8080 --key sk-iop-... -n 10000

Opens ``-n`` connections (real TCP) and warms each with one ``/healthz``, then sends one
chat request on each at once and reads its status line: the requests arrive together, on
connections the server already holds. Prints one JSON object: the statuses counted, the
connections refused or cut, and how long the burst took. It runs in its own process so
that, on a small machine, the clients do not share the edge's event loop or starve it of
a core any more than the operating system lets them (issue 29, item 7: the flood that dropped
every node link). Run against ``make run``'s stack, or by tests/faults/test_flood.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

BODY = '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":2}'


def request_bytes(host: str, model: str, key: str, prompt_chars: int) -> bytes:
    body = (BODY % (model, "hi " * (prompt_chars // 3))).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


WARM_UP = b"GET /healthz HTTP/1.1\r\nHost: %s\r\n\r\n"
RETRIES = 3  # a connection the server closed before it took the request: open another


class Burst:
    """The clients' shared state: how many have settled (opened, or failed to), and the
    connections holding all of their request but its last byte until the burst fires."""

    def __init__(self, n: int, request: bytes) -> None:
        self.n = n
        self.head, self.tail = request[:-1], request[-1:]
        self.settled = 0
        self.all_settled = asyncio.Event()
        self.held: list[asyncio.StreamWriter] = []
        self.fired = asyncio.Event()

    def settle(self) -> None:
        self.settled += 1
        if self.settled == self.n:
            self.all_settled.set()

    def fire(self) -> None:
        """The last byte of every held request, in one pass: they arrive together."""
        for writer in self.held:
            writer.write(self.tail)
        self.held.clear()
        self.fired.set()


async def one(host: str, port: int, burst: Burst, timeout_s: float) -> str:
    """One client: a connection opened and warmed (one answered ``/healthz``: the server
    holds it, not only the kernel's backlog), its request written but for its last byte,
    which ``Burst.fire`` sends with everyone else's; a client that gets in after the burst
    sends its whole request at once. Its status code, or what went wrong, as a label."""
    settled = False
    warm = True
    try:
        async with asyncio.timeout(timeout_s):
            for _ in range(RETRIES):
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                    if warm:
                        writer.write(WARM_UP % host.encode())
                        status = await _skip_answer(reader)
                        if status != b"200":  # refused at the door (a server at its cap)
                            writer.close()
                            return status.decode() or "closed without an answer"
                finally:
                    if not settled:
                        settled = True
                        burst.settle()
                try:
                    if burst.fired.is_set():
                        writer.write(burst.head + burst.tail)
                    else:
                        writer.write(burst.head)
                        burst.held.append(writer)
                    line = await reader.readline()
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
                parts = line.split()
                if len(parts) >= 2:
                    return parts[1].decode()
                warm = False  # closed (idle too long?): the request alone, on a new connection
    except TimeoutError:
        return "timeout"
    except (OSError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    return "closed without an answer"


async def _skip_answer(reader: asyncio.StreamReader) -> bytes:
    """Read one answer with a ``Content-Length`` (the warm-up's); its status code."""
    parts = (await reader.readline()).split()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return parts[1] if len(parts) >= 2 else b""


async def flood(
    url: str, key: str, model: str, n: int, timeout_s: float, ramp_s: float, prompt_chars: int
) -> dict[str, object]:
    """Open ``n`` connections, then complete every request at once: when all are open, or
    ``ramp_s`` after the first attempt (a server at its cap refuses the rest, or leaves
    them in its backlog; those send as soon as they get in)."""
    split = urlsplit(url)
    host, port = split.hostname or "127.0.0.1", split.port or 80
    burst = Burst(n, request_bytes(host, model, key, prompt_chars))
    started = time.monotonic()
    tasks = [asyncio.create_task(one(host, port, burst, timeout_s)) for _ in range(n)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(burst.all_settled.wait(), ramp_s)
    opened = burst.settled
    held = len(burst.held)
    burst.fire()
    fired_at = time.monotonic()
    outcomes = Counter(await asyncio.gather(*tasks))
    return {
        "requests": n,
        "settled_before_the_burst": opened,
        "fired_together": held,
        "outcomes": dict(outcomes),
        "ramp_seconds": fired_at - started,
        "seconds": time.monotonic() - fired_at,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the edge's origin, http://host:port")
    parser.add_argument("--key", required=True, help="the API key every request carries")
    parser.add_argument("--model", default="mock-small")
    parser.add_argument("-n", type=int, default=10_000, help="concurrent requests")
    parser.add_argument("--prompt-chars", type=int, default=2, help="the prompt's length")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument(
        "--ramp", type=float, default=30.0, help="longest wait for the connections to open"
    )
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.n + 64:  # one descriptor per connection
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.n + 64), hard))
    burst = flood(
        args.url, args.key, args.model, args.n, args.timeout, args.ramp, args.prompt_chars
    )
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(burst)
    else:
        result = uvloop.run(burst)
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
