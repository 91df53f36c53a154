"""tools/devcerts.py: what it writes, what it refuses to overwrite, and that the result does mTLS.

The generator is loaded from its path because ``tools/`` is not a package.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from iop_proto.tls import PeerIdentity, TlsSettings, client_context, peer_identity, server_context

SCRIPT = Path(__file__).resolve().parent / "devcerts.py"
DEFAULT_IDENTITIES = {
    "edge": "edge",
    "control-plane": "control-plane",
    "node-a": "node",
    "node-b": "node",
    "worker": "worker",
}


def _load_devcerts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("iop_tools_devcerts", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


devcerts = _load_devcerts()


def run(out: Path, *args: str) -> int:
    return int(devcerts.main(["--out", str(out), *args]))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def attribute(name: x509.Name, oid: x509.ObjectIdentifier) -> str:
    values = name.get_attributes_for_oid(oid)
    assert len(values) == 1
    value = values[0].value
    assert isinstance(value, str)
    return value


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A fresh directory with the default identities generated into it."""
    directory = tmp_path / "certs" / "dev"
    assert run(directory) == 0
    return directory


def expected_files(identities: dict[str, str]) -> set[str]:
    return {f"{n}.{ext}" for n in ["ca", *identities] for ext in ("pem", "key")}


def test_writes_ca_and_every_default_identity(out: Path) -> None:
    assert {p.name for p in out.iterdir()} == expected_files(DEFAULT_IDENTITIES)


def test_ca_is_a_leaf_only_signing_authority(out: Path) -> None:
    ca = load_cert(out / "ca.pem")
    ca.verify_directly_issued_by(ca)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert constraints.value.ca
    assert constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign
    assert usage.crl_sign


@pytest.mark.parametrize(("name", "role"), sorted(DEFAULT_IDENTITIES.items()))
def test_leaf_names_identity_role_and_hosts(out: Path, name: str, role: str) -> None:
    ca = load_cert(out / "ca.pem")
    leaf = load_cert(out / f"{name}.pem")
    leaf.verify_directly_issued_by(ca)

    assert attribute(leaf.subject, NameOID.COMMON_NAME) == name
    assert attribute(leaf.subject, NameOID.ORGANIZATIONAL_UNIT_NAME) == role
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", name}
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.IPv4Address("127.0.0.1")]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    public = leaf.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert isinstance(public.curve, ec.SECP256R1)


def test_key_files_are_private(out: Path) -> None:
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name


def test_days_sets_the_validity(tmp_path: Path) -> None:
    assert run(tmp_path, "--days", "3") == 0
    leaf = load_cert(tmp_path / "edge.pem")
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert 3 * 86400 <= lifetime.total_seconds() <= 3 * 86400 + 3600


def sans_of(path: Path) -> set[str]:
    sans = load_cert(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {f"DNS:{n}" for n in sans.get_values_for_type(x509.DNSName)} | {
        f"IP:{a}" for a in sans.get_values_for_type(x509.IPAddress)
    }


def test_identities_given_are_the_only_ones_issued(tmp_path: Path) -> None:
    assert run(tmp_path, "--identity", "probe:tester", "--identity", "edge:edge") == 0
    assert {p.name for p in tmp_path.iterdir()} == expected_files(
        {"probe": "tester", "edge": "edge"}
    )
    leaf = load_cert(tmp_path / "probe.pem")
    assert attribute(leaf.subject, NameOID.COMMON_NAME) == "probe"
    assert attribute(leaf.subject, NameOID.ORGANIZATIONAL_UNIT_NAME) == "tester"
    # A fleet leaf names its identity, not every host's loopback.
    assert sans_of(tmp_path / "probe.pem") == {"DNS:probe"}


def test_san_adds_names_to_one_identity(tmp_path: Path) -> None:
    args = ["--identity", "edge:edge", "--identity", "node-c:node"]
    sans = ["--san", "edge=DNS:gw.example.org", "--san", "edge=IP:10.0.0.1"]
    assert run(tmp_path, *args, *sans, "--san", "node-c=IP:fd00::3") == 0
    assert sans_of(tmp_path / "edge.pem") == {"DNS:edge", "DNS:gw.example.org", "IP:10.0.0.1"}
    assert sans_of(tmp_path / "node-c.pem") == {"DNS:node-c", "IP:fd00::3"}


def test_san_on_the_dev_set_keeps_the_loopback_names(tmp_path: Path) -> None:
    assert run(tmp_path, "--san", "edge=IP:10.0.0.1") == 0
    assert {p.name for p in tmp_path.iterdir()} == expected_files(DEFAULT_IDENTITIES)
    assert sans_of(tmp_path / "edge.pem") == {
        "DNS:edge",
        "DNS:localhost",
        "IP:127.0.0.1",
        "IP:10.0.0.1",
    }
    assert sans_of(tmp_path / "worker.pem") == {"DNS:worker", "DNS:localhost", "IP:127.0.0.1"}


@pytest.mark.parametrize(
    "bad", ["edge", "edge=10.0.0.1", "edge=IP:10.0.0", "edge=DNS:a_b", "=IP:::1"]
)
def test_malformed_san_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, "--san", bad)
    assert exc.value.code == 2
    assert not tmp_path.joinpath("ca.pem").exists()


def test_san_for_an_identity_not_issued_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, "--identity", "edge:edge", "--san", "node-a=IP:10.0.0.2") == 1
    assert "--identity node-a:ROLE" in capsys.readouterr().err
    assert not tmp_path.joinpath("ca.pem").exists()


def test_leaf_with_other_names_is_an_error_until_reissued(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(out)
    capsys.readouterr()
    assert run(out, "--san", "edge=IP:10.0.0.1") == 1
    err = capsys.readouterr().err
    assert "names DNS:edge, DNS:localhost, IP:127.0.0.1, but" in err
    assert "IP:10.0.0.1 was asked" in err
    assert "--reissue edge" in err
    assert snapshot(out) == before

    assert run(out, "--san", "edge=IP:10.0.0.1", "--reissue", "edge") == 0
    after = snapshot(out)
    unchanged = {n for n in before if not n.startswith("edge.")}
    assert {n: after[n] for n in unchanged} == {n: before[n] for n in unchanged}
    assert after["edge.key"] != before["edge.key"]
    assert "IP:10.0.0.1" in sans_of(out / "edge.pem")
    load_cert(out / "edge.pem").verify_directly_issued_by(load_cert(out / "ca.pem"))
    assert stat.S_IMODE((out / "edge.key").stat().st_mode) == 0o600
    # Asked again the same way, the reissued leaf is kept.
    assert run(out, "--san", "edge=IP:10.0.0.1") == 0
    assert snapshot(out) == after


def test_leaf_with_another_role_is_an_error(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(out)
    capsys.readouterr()
    assert run(out, "--identity", "node-a:worker") == 1
    assert "role node, not worker" in capsys.readouterr().err
    assert snapshot(out) == before


def test_reissue_of_an_identity_not_asked_for_fails(out: Path) -> None:
    before = snapshot(out)
    assert run(out, "--reissue", "nobody") == 1
    assert snapshot(out) == before


@pytest.mark.parametrize("bad", ["noroleseparator", "Bad_Name:node", "ca:node", "x:"])
def test_malformed_identity_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, "--identity", bad)
    assert exc.value.code == 2
    assert not tmp_path.joinpath("ca.pem").exists()


def test_conflicting_roles_for_one_identity_fail(tmp_path: Path) -> None:
    assert run(tmp_path, "--identity", "edge:edge", "--identity", "edge:worker") == 1
    assert not tmp_path.joinpath("ca.pem").exists()


def test_second_run_keeps_every_file(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(out)
    capsys.readouterr()
    assert run(out) == 0
    assert snapshot(out) == before
    assert "keeping them" in capsys.readouterr().out


def test_force_replaces_every_file(out: Path) -> None:
    before = snapshot(out)
    assert run(out, "--force") == 0
    after = snapshot(out)
    assert after.keys() == before.keys()
    assert all(after[name] != before[name] for name in before)
    ca = load_cert(out / "ca.pem")
    for name in DEFAULT_IDENTITIES:
        load_cert(out / f"{name}.pem").verify_directly_issued_by(ca)
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name


def test_missing_leaf_is_reissued_by_the_existing_ca(out: Path) -> None:
    before = snapshot(out)
    (out / "node-b.pem").unlink()
    (out / "node-b.key").unlink()
    assert run(out) == 0
    after = snapshot(out)
    unchanged = {n for n in before if not n.startswith("node-b.")}
    assert {n: after[n] for n in unchanged} == {n: before[n] for n in unchanged}
    assert after["node-b.pem"] != before["node-b.pem"]
    load_cert(out / "node-b.pem").verify_directly_issued_by(load_cert(out / "ca.pem"))
    assert stat.S_IMODE((out / "node-b.key").stat().st_mode) == 0o600


def test_new_identity_is_issued_by_the_existing_ca(out: Path) -> None:
    before = snapshot(out)
    assert run(out, "--identity", "probe:tester", "--san", "probe=IP:10.0.0.9") == 0
    after = snapshot(out)
    assert {n: after[n] for n in before} == before
    assert set(after) - set(before) == {"probe.pem", "probe.key"}
    load_cert(out / "probe.pem").verify_directly_issued_by(load_cert(out / "ca.pem"))


def test_missing_ca_key_with_leaves_present_fails(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (out / "ca.key").unlink()
    (out / "worker.pem").unlink()
    (out / "worker.key").unlink()
    before = snapshot(out)
    capsys.readouterr()
    assert run(out) != 0
    assert "--force" in capsys.readouterr().err
    assert snapshot(out) == before


def test_missing_ca_key_with_every_leaf_present_fails(out: Path) -> None:
    (out / "ca.key").unlink()
    before = snapshot(out)
    assert run(out) != 0
    assert snapshot(out) == before


def test_missing_ca_with_leaves_present_fails(out: Path) -> None:
    (out / "ca.key").unlink()
    (out / "ca.pem").unlink()
    before = snapshot(out)
    assert run(out) != 0
    assert snapshot(out) == before


def test_half_a_leaf_is_not_overwritten(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (out / "edge.key").unlink()
    before = snapshot(out)
    capsys.readouterr()
    assert run(out) != 0
    assert "--force" in capsys.readouterr().err
    assert snapshot(out) == before


def test_command_line_entry_point(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--days", "1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout
    assert {p.name for p in tmp_path.iterdir()} == expected_files(DEFAULT_IDENTITIES)


def settings(out: Path, name: str) -> TlsSettings:
    return TlsSettings(
        ca_file=out / "ca.pem", cert_file=out / f"{name}.pem", key_file=out / f"{name}.key"
    )


async def test_generated_certificates_complete_a_mutual_tls_handshake(out: Path) -> None:
    """The edge serves, node-a connects: each side verifies the other and reads its identity."""
    server_ctx = server_context(settings(out, "edge"))
    client_ctx = client_context(settings(out, "node-a"))
    assert server_ctx.verify_mode is ssl.CERT_REQUIRED
    assert client_ctx.check_hostname
    seen: asyncio.Future[PeerIdentity | None] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.set_result(peer_identity(writer))
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname="localhost"
        )
        try:
            writer.write(b"ping\n")
            await writer.drain()
            assert await asyncio.wait_for(reader.readline(), 10) == b"ping\n"
            assert peer_identity(writer) == PeerIdentity(name="edge", role="edge")
        finally:
            writer.close()
            await writer.wait_closed()
        assert await asyncio.wait_for(seen, 10) == PeerIdentity(name="node-a", role="node")
    finally:
        server.close()
        await server.wait_closed()


async def test_ip_san_lets_a_peer_dial_by_address(tmp_path: Path) -> None:
    """A leaf without the address fails the client's check; with --san it verifies."""
    base = ["--identity", "edge:edge", "--identity", "node-a:node"]
    assert run(tmp_path, *base) == 0
    client_ctx = client_context(settings(tmp_path, "node-a"))

    async def handshake() -> None:
        server = await asyncio.start_server(
            lambda _r, w: w.close(), "127.0.0.1", 0, ssl=server_context(settings(tmp_path, "edge"))
        )
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname="127.0.0.1"
            )
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        await handshake()
    assert run(tmp_path, *base, "--san", "edge=IP:127.0.0.1", "--reissue", "edge") == 0
    await handshake()
