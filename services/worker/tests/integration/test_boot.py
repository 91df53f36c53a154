"""The worker starts from its example config, serves its admin port, and stops on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import trustme

from iop_proto.testing import running_service, stop_service, write_identity

ROOT = Path(__file__).resolve().parents[4]


async def test_boots_from_example_config_and_stops_on_sigterm(tmp_path: Path) -> None:
    tls = write_identity(trustme.CA(), tmp_path, "worker", "worker")
    env = {
        "IOP_ADMIN__PORT": "0",
        "IOP_TLS__CA_FILE": str(tls.ca_file),
        "IOP_TLS__CERT_FILE": str(tls.cert_file),
        "IOP_TLS__KEY_FILE": str(tls.key_file),
        "IOP_EDGE__HOST": "127.0.0.1",
        "IOP_EDGE__PORT": "1",  # nothing listens there: the worker keeps retrying, still healthy
    }
    config = ROOT / "configs" / "worker.yaml"
    async with running_service("iop-worker", config, env) as service:
        await service.wait_for_line("cannot reach the edge at 127.0.0.1:1")
        await service.wait_for_line("reconnecting to the edge in")
        await service.wait_for_line("(attempt 3)")  # it failed twice and goes on trying
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{service.admin_url}/healthz") as response:
                assert response.status == 200
                assert (await response.json())["service"] == "worker"
            async with http.get(f"{service.admin_url}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == "not registered with the edge"
            async with http.get(f"{service.admin_url}/metrics") as response:
                assert response.status == 200
                text = await response.text()
                assert 'iop_build_info{service="worker"' in text
                assert "iop_worker_edge_connected 0.0" in text
                assert 'iop_worker_batches_total{outcome="finished"} 0.0' in text
        assert await stop_service(service) == 0
    assert any("stopped worker" in line for line in service.log)
