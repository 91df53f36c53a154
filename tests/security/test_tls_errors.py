"""TLS failures explain themselves, on both sides, between real processes on real sockets.

A node whose view of the edge's certificate does not fit (a name the certificate lacks,
a CA it does not trust) stops with exit code 2 and a line saying what did not match and
which setting fixes it, instead of retrying forever; the edge says the node closed
during the handshake, not that it refused it. A node whose own certificate the edge
rejects is told by the edge's log why, and keeps retrying (from its side the edge just
closed). Configuration errors found at start (certificate files, token file, settings
file) exit 2 too.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from iop_proto.testing import RunningService, running_service, write_identity

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXIT_BAD_SETTINGS = 2


def node_settings(stack: Any, path: Path, pki: Path, name: str, **edge: object) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "service_id": name,
                "admin": {"host": "127.0.0.1", "port": 0},
                "tls": {
                    "ca_file": str(pki / "ca.pem"),
                    "cert_file": str(pki / f"{name}.pem"),
                    "key_file": str(pki / f"{name}.key"),
                },
                "edge": {"host": "127.0.0.1", "port": stack.node_port, **edge},
                "token": "iopnt_never_sent_before_the_handshake",
                "history_db": str(path.with_suffix(".db")),
                "reconnect": {"initial_s": 0.1, "max_s": 0.3},
            }
        )
    )
    return path


async def exit_code(service: RunningService) -> int:
    return await asyncio.wait_for(service.process.wait(), 30)


def text(service: RunningService) -> str:
    return "".join(service.log)


async def test_a_name_the_edge_s_certificate_lacks_stops_the_node(
    stack: Any, tmp_path: Path
) -> None:
    write_identity(stack.ca, tmp_path, "node-c", "node")
    config = node_settings(
        stack, tmp_path / "node-c.yaml", tmp_path, "node-c", server_name="gw.lan"
    )
    async with running_service("iop-node", config) as node:
        assert await exit_code(node) == EXIT_BAD_SETTINGS
        await asyncio.sleep(0.2)  # the last lines of its log
    log = text(node)
    assert "the edge's certificate is not valid for gw.lan: it names " in log
    assert "DNS:localhost" in log
    assert "IP:127.0.0.1" in log
    assert "set edge.server_name to one of those" in log
    assert "devcerts --san edge=DNS:gw.lan" in log
    assert "configuration error" in log
    assert log.count("not valid for gw.lan") == 1, log  # stopped, not retried
    assert "Traceback" not in log
    # The edge did not refuse anything: it says who ended the handshake.
    line = await stack.services["edge"].wait_for_line("TLS handshake with")
    assert "the peer closed during the TLS handshake" in line
    assert "refused" not in line


async def test_a_worker_stops_on_the_same_mismatch(stack: Any, tmp_path: Path) -> None:
    data = yaml.safe_load((stack.root / "worker.yaml").read_text())
    data["edge"]["server_name"] = "10.9.9.9"
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump(data))
    async with running_service("iop-worker", config) as worker:
        assert await exit_code(worker) == EXIT_BAD_SETTINGS
        await asyncio.sleep(0.2)
    log = text(worker)
    assert "the edge's certificate is not valid for 10.9.9.9" in log
    assert "devcerts --san edge=IP:10.9.9.9" in log
    assert "Traceback" not in log


async def test_a_node_that_does_not_trust_the_edge_s_ca_stops(stack: Any, tmp_path: Path) -> None:
    write_identity(trustme.CA(), tmp_path, "node-c", "node")  # its ca.pem: another CA
    config = node_settings(stack, tmp_path / "node-c.yaml", tmp_path, "node-c")
    async with running_service("iop-node", config) as node:
        assert await exit_code(node) == EXIT_BAD_SETTINGS
        await asyncio.sleep(0.2)
    log = text(node)
    assert "the edge's certificate is not signed by the CA in our tls.ca_file" in log
    assert str(tmp_path / "ca.pem") in log


async def test_the_edge_says_why_it_rejected_a_certificate_from_another_ca(
    stack: Any, tmp_path: Path
) -> None:
    write_identity(trustme.CA(), tmp_path / "other", "node-c", "node")
    (tmp_path / "other" / "ca.pem").write_bytes((stack.root / "pki" / "ca.pem").read_bytes())
    config = node_settings(stack, tmp_path / "node-c.yaml", tmp_path / "other", "node-c")
    async with running_service("iop-node", config) as node:
        line = await stack.services["edge"].wait_for_line("certificate_untrusted")
        assert "its certificate is not signed by the CA in our tls.ca_file" in line
        # From the node's side the edge closed after the handshake: said so, and retried.
        await node.wait_for_line("it most likely rejected our certificate")
        await node.wait_for_line("reconnecting to the edge")
        assert node.process.returncode is None


async def test_missing_certificate_files_exit_2_with_one_line(tmp_path: Path, stack: Any) -> None:
    config = node_settings(stack, tmp_path / "node-c.yaml", tmp_path / "nowhere", "node-c")
    code, err = await run_to_exit("iop-node", config)
    assert code == EXIT_BAD_SETTINGS
    assert "cannot load TLS files" in err
    assert "Traceback" not in err


async def test_a_missing_token_file_exits_2(tmp_path: Path, stack: Any) -> None:
    write_identity(stack.ca, tmp_path, "node-c", "node")
    config = node_settings(stack, tmp_path / "node-c.yaml", tmp_path, "node-c")
    data = yaml.safe_load(config.read_text())
    data.pop("token")
    data["token_file"] = str(tmp_path / "absent.token")
    config.write_text(yaml.safe_dump(data))
    code, err = await run_to_exit("iop-node", config)
    assert code == EXIT_BAD_SETTINGS
    assert "token_file" in err
    assert "--output FILE" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("script", ["iop-node", "iop-edge", "iop-worker", "iop-control-plane"])
async def test_a_broken_settings_file_exits_2(tmp_path: Path, script: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("service_id: [unclosed\n")
    code, err = await run_to_exit(script, config)
    assert code == EXIT_BAD_SETTINGS, err
    assert str(config) in err


async def run_to_exit(script: str, config: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / script),
        "--config",
        str(config),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("IOP_")},
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, err.decode()
