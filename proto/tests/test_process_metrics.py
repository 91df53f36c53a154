"""Process gauges on every service's /metrics: fds, sockets and tasks follow what is open."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from iop_proto.service import AdminServer, ServiceSettings, load_settings
from iop_proto.service.process_metrics import count_open_sockets
from iop_proto.service.runner import serve

CONFIG = """\
service_id: svc-1
admin: {host: 127.0.0.1, port: 0}
tls: {enabled: false}
"""


async def scrape(http: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def test_fds_sockets_and_tasks_are_counted_at_scrape_time(tmp_path: Path) -> None:
    config = tmp_path / "svc.yaml"
    config.write_text(CONFIG)
    settings = load_settings(ServiceSettings, config)
    stop = asyncio.Event()
    admins: list[AdminServer] = []
    built = asyncio.Event()

    @contextlib.asynccontextmanager
    async def build(
        s: ServiceSettings, registry: CollectorRegistry, admin: AdminServer
    ) -> AsyncIterator[None]:
        admins.append(admin)
        built.set()
        yield

    service = asyncio.create_task(serve("svc", "1.0", settings, build, stop))
    try:
        await asyncio.wait_for(built.wait(), 5)
        await asyncio.wait_for(admins[0].started.wait(), 5)
        port = admins[0].port
        # A collection inside the window would close sockets that earlier tests in this
        # worker left to the garbage collector, and the counts would drift by those.
        gc.collect()
        gc.disable()
        async with aiohttp.ClientSession() as http:
            before = await scrape(http, port)
            sleepers = [asyncio.create_task(asyncio.sleep(60)) for _ in range(5)]
            sockets = [socket.socket() for _ in range(3)]
            try:
                during = await scrape(http, port)
            finally:
                for sock in sockets:
                    sock.close()
                for sleeper in sleepers:
                    sleeper.cancel()
                await asyncio.gather(*sleepers, return_exceptions=True)
            after = await scrape(http, port)
    finally:
        gc.enable()
        stop.set()
        await asyncio.wait_for(service, 5)

    assert before["process_open_fds"] > 0
    assert during["process_open_fds"] == before["process_open_fds"] + 3
    assert during["iop_open_sockets"] == before["iop_open_sockets"] + 3
    assert during["iop_asyncio_tasks"] == before["iop_asyncio_tasks"] + 5
    assert after["iop_open_sockets"] == before["iop_open_sockets"]
    assert after["iop_asyncio_tasks"] == before["iop_asyncio_tasks"]


def test_count_open_sockets_sees_a_new_socket() -> None:
    gc.collect()
    gc.disable()
    try:
        base = count_open_sockets()
        with socket.socket():
            assert count_open_sockets() == base + 1
        assert count_open_sockets() == base
    finally:
        gc.enable()
