"""The edge starts from its example config, serves its admin port, and stops on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import trustme

from iop_proto.testing import running_service, stop_service, write_identity

ROOT = Path(__file__).resolve().parents[4]


async def test_boots_from_example_config_and_stops_on_sigterm(tmp_path: Path) -> None:
    tls = write_identity(trustme.CA(), tmp_path, "edge", "edge")
    env = {
        "IOP_ADMIN__PORT": "0",
        "IOP_HTTP__PORT": "0",  # every port 0: the ready line names the bound ones
        "IOP_NODE_LISTENER__PORT": "0",
        "IOP_TLS__CA_FILE": str(tls.ca_file),
        "IOP_TLS__CERT_FILE": str(tls.cert_file),
        "IOP_TLS__KEY_FILE": str(tls.key_file),
    }
    config = ROOT / "configs" / "edge.yaml"
    async with running_service("iop-edge", config, env) as service:
        assert set(service.ports) == {"http", "nodes"}
        assert all(service.ports.values())
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{service.admin_url}/healthz") as response:
                assert response.status == 200
                assert (await response.json())["service"] == "edge"
            async with http.get(f"{service.admin_url}/metrics") as response:
                assert response.status == 200
                assert 'iop_build_info{service="edge"' in await response.text()
        assert await stop_service(service) == 0
    assert any("stopped edge" in line for line in service.log)
