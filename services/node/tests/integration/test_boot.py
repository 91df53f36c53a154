"""The node starts from its example config, serves its admin port, and stops on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import trustme

from iop_proto.testing import running_service, stop_service, write_identity

ROOT = Path(__file__).resolve().parents[4]


async def test_boots_from_example_config_and_stops_on_sigterm(tmp_path: Path) -> None:
    tls = write_identity(trustme.CA(), tmp_path, "node-a", "node")
    env = {
        "IOP_ADMIN__PORT": "0",
        "IOP_TLS__CA_FILE": str(tls.ca_file),
        "IOP_TLS__CERT_FILE": str(tls.cert_file),
        "IOP_TLS__KEY_FILE": str(tls.key_file),
        "IOP_TOKEN": "iopnt_boot-test",
        "IOP_HISTORY_DB": str(tmp_path / "history.db"),
        "IOP_EDGE__PORT": "1",  # nothing listens there: the node keeps retrying, still healthy
    }
    config = ROOT / "configs" / "node.yaml"
    async with running_service("iop-node", config, env) as service:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{service.admin_url}/healthz") as response:
                assert response.status == 200
                assert (await response.json())["service"] == "node"
            async with http.get(f"{service.admin_url}/metrics") as response:
                assert response.status == 200
                assert 'iop_build_info{service="node"' in await response.text()
        assert await stop_service(service) == 0
    assert any("stopped node-a" in line for line in service.log)
