"""Every listening HTTP port of every service closes idle connections and holds a bounded
number: an attacker cannot pin descriptors (19,700 idle connections were once held on the
edge's admin port, near its descriptor limit).

The ports: the edge's public API and the admin port (``/healthz``, ``/metrics``) of the
control-plane, the edge, both nodes and the worker. For each, against a real stack:

- a connection kept alive after its answer, then left idle, is closed by the server
  (the admin ports' ``admin.idle_timeout_s``, 15 s by default; the API's
  ``http.read_timeout_s``);
- with ``max_connections`` held open, the next connection is answered a 503 with
  ``Retry-After`` at once, not served and not left hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ADMIN_MAX_CONNECTIONS = 128  # AdminSettings.max_connections' default
API_MAX_CONNECTIONS = 512  # the edge's http.max_connections' default
IDLE_CLOSED_WITHIN_S = 45  # the longest idle timeout here is 15 s: three times that
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {"id": provider_id, "type": "mock", "category": "local_inference", "models": [served]}


FLEET: dict[str, object] = {
    "models": [
        {"id": "mock-small", "providers": {"node-a-mock": "small-a", "node-b-mock": "small-b"}}
    ],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "small-a")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "small-b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}


def http_ports(stack: Any) -> dict[str, tuple[int, int]]:
    """Each HTTP port: its number and its connection cap."""
    api = int(stack.api_url.rsplit(":", 1)[1].split("/", 1)[0])
    ports = {"edge api": (api, API_MAX_CONNECTIONS)}
    for name, service in stack.services.items():
        ports[f"{name} admin"] = (int(service.admin_url.rsplit(":", 1)[1]), ADMIN_MAX_CONNECTIONS)
    return ports


async def idle_is_closed(port: int) -> bool:
    """One answered request, then silence: does the server close the connection?"""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEALTHZ)
        async with asyncio.timeout(IDLE_CLOSED_WITHIN_S):
            answer = await reader.read()  # returns at the server's close
        return answer.startswith(b"HTTP/1.1 200")
    except TimeoutError:
        return False
    finally:
        writer.close()


async def refused_over_the_cap(port: int, cap: int) -> bytes:
    """Hold ``cap`` kept-alive connections (each answered once), then open one more: what it
    is answered (nothing: the server let it hang)."""
    held = []
    try:
        for _ in range(cap):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(HEALTHZ)
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        held.append(writer)
        writer.write(HEALTHZ)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):  # a refusal is immediate; a served one stays open
                return await reader.read()
        return b""
    finally:
        for writer in held:
            writer.close()


async def test_every_http_port_closes_idle_connections_and_caps_the_rest(
    tmp_path: Path, start_stack_factory: Any
) -> None:
    http = {"host": "127.0.0.1", "port": 0, "read_timeout_s": 15}  # holding 512 takes less
    async with start_stack_factory(tmp_path, FLEET, {"http": http}) as stack:
        ports = http_ports(stack)
        closed = await asyncio.gather(*(idle_is_closed(port) for port, _ in ports.values()))
        kept_open = [name for name, ok in zip(ports, closed, strict=True) if not ok]
        over = {name: await refused_over_the_cap(*port) for name, port in ports.items()}
    print(f"\n[http ports] idle connections kept open: {kept_open or 'none'}")
    print(f"[http ports] over the cap: { {n: a[:40] for n, a in over.items()} }")
    assert not kept_open
    for name, answer in over.items():
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), (name, answer[:200])
        assert b"Retry-After: 1\r\n" in answer, name
