"""deploy/init/iop_init.py, the compose stack's one-shot, run for real on temporary directories.

The same program the `iop-init` image runs, with the same tools: tools/devcerts.py for the
certificates and the control-plane's `token` commands, on the compose stack's own control-plane
settings (the database path moved by `IOP_DATABASE`, as any key can be). The tokens are
checked with the `iop-control-plane` console script itself. No `--devcerts`: run from a
checkout, iop_init finds tools/devcerts.py by itself.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "deploy" / "init" / "iop_init.py"
CP_SETTINGS = ROOT / "deploy" / "compose" / "control-plane.yaml"
CONTROL_PLANE = Path(sys.executable).parent / "iop-control-plane"
NODES = ["node-a", "node-b", "node-gpu"]
ROLES = {"control-plane": "control-plane", "edge": "edge", "worker": "worker"} | {
    node: "node" for node in NODES
}


@dataclass(frozen=True)
class Volumes:
    """The init's four directories, as the compose named volumes would be."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def tokens(self) -> Path:
        return self.root / "tokens"

    @property
    def database(self) -> Path:
        return self.root / "control-plane" / "credentials.db"

    def env(self) -> dict[str, str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
        return {**clean, "IOP_DATABASE": str(self.database)}

    def run(self, *args: str, user: str | None = None) -> subprocess.CompletedProcess[bytes]:
        ids = user or f"{os.getuid()}:{os.getgid()}"
        command = [
            sys.executable,
            str(INIT),
            "--config",
            str(CP_SETTINGS),
            "--pki",
            str(self.pki),
            "--certs",
            str(self.certs),
            "--tokens",
            str(self.tokens),
            "--user",
            ids,
            *args,
        ]
        return subprocess.run(command, env=self.env(), capture_output=True, timeout=120)

    def live_tokens(self) -> dict[str, int]:
        out = subprocess.run(
            [str(CONTROL_PLANE), "--config", str(CP_SETTINGS), "token", "list", "--json"],
            env=self.env(),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        counts: dict[str, int] = {}
        for token in json.loads(out):
            if token["revoked_at"] is None:
                counts[token["node_id"]] = counts.get(token["node_id"], 0) + 1
        return counts


def node_args(nodes: list[str]) -> list[str]:
    return [word for node in nodes for word in ("--node", node)]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def subject(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> str:
    return str(cert.subject.get_attributes_for_oid(oid)[0].value)


@pytest.fixture
def volumes(tmp_path: Path) -> Volumes:
    return Volumes(tmp_path)


def test_init_makes_certificates_and_tokens_once(volumes: Volumes) -> None:
    first = volumes.run(*node_args(NODES))
    assert first.returncode == 0, first.stderr.decode()
    assert first.stdout == b""  # progress goes to stderr; stdout is for --bundle

    # The CA key stays in the private directory; the shared one has the rest.
    assert (volumes.pki / "ca.key").is_file()
    assert stat.S_IMODE(volumes.pki.stat().st_mode) == 0o700
    published = {path.name for path in volumes.certs.iterdir()}
    expected = {"ca.pem"} | {f"{name}.{ext}" for name in ROLES for ext in ("pem", "key")}
    assert published == expected
    ca = x509.load_pem_x509_certificate((volumes.certs / "ca.pem").read_bytes())
    for name, role in ROLES.items():
        cert = x509.load_pem_x509_certificate((volumes.certs / f"{name}.pem").read_bytes())
        assert subject(cert, NameOID.COMMON_NAME) == name
        assert subject(cert, NameOID.ORGANIZATIONAL_UNIT_NAME) == role
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert name in sans.get_values_for_type(x509.DNSName)  # the compose service name
        key_mode = (volumes.certs / f"{name}.key").stat().st_mode
        assert stat.S_IMODE(key_mode) == 0o600

    # One token file per node, each live in the control-plane's database.
    assert sorted(path.name for path in volumes.tokens.iterdir()) == [f"{n}.token" for n in NODES]
    for node in NODES:
        token_file = volumes.tokens / f"{node}.token"
        assert token_file.read_text().startswith("iopnt_")
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert volumes.live_tokens() == dict.fromkeys(NODES, 1)

    # A second run (every `docker compose up`) changes nothing.
    before = (snapshot(volumes.pki), snapshot(volumes.certs), snapshot(volumes.tokens))
    second = volumes.run(*node_args(NODES))
    assert second.returncode == 0, second.stderr.decode()
    assert (snapshot(volumes.pki), snapshot(volumes.certs), snapshot(volumes.tokens)) == before
    assert volumes.live_tokens() == dict.fromkeys(NODES, 1)
    assert b"published" not in second.stderr
    assert b"iopnt_" not in first.stderr + second.stderr  # a secret is never logged


def test_init_issues_again_when_the_database_lost_the_token(volumes: Volumes) -> None:
    assert volumes.run(*node_args(NODES)).returncode == 0
    old = (volumes.tokens / "node-a.token").read_text()
    volumes.database.unlink()  # e.g. the control-plane's volume was removed alone
    result = volumes.run(*node_args(NODES))
    assert result.returncode == 0, result.stderr.decode()
    assert (volumes.tokens / "node-a.token").read_text() != old
    assert volumes.live_tokens() == dict.fromkeys(NODES, 1)


def test_init_for_real_hosts_issues_only_the_identities_named(volumes: Volumes) -> None:
    """`--identity` and `--san` go to devcerts: the fleet's leaves, for the hosts' addresses."""
    result = volumes.run(
        "--identity",
        "edge:edge",
        "--identity",
        "control-plane:control-plane",
        "--node",
        "node-c",
        "--san",
        "edge=IP:10.0.0.1",
        "--san",
        "node-c=DNS:gpu1.example.org",
    )
    assert result.returncode == 0, result.stderr.decode()
    names = {"edge", "control-plane", "node-c"}
    assert {p.name for p in volumes.certs.iterdir()} == {"ca.pem"} | {
        f"{n}.{ext}" for n in names for ext in ("pem", "key")
    }
    edge = x509.load_pem_x509_certificate((volumes.certs / "edge.pem").read_bytes())
    sans = edge.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["edge"]
    node = x509.load_pem_x509_certificate((volumes.certs / "node-c.pem").read_bytes())
    assert subject(node, NameOID.ORGANIZATIONAL_UNIT_NAME) == "node"
    node_sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(node_sans.get_values_for_type(x509.DNSName)) == {"node-c", "gpu1.example.org"}
    assert volumes.live_tokens() == {"node-c": 1}


def test_init_refuses_a_bad_node_id(volumes: Volumes) -> None:
    result = volumes.run("--node", "Node_A")
    assert result.returncode == 2  # argparse: nothing was written
    assert not volumes.pki.exists()


def test_bundle_is_what_a_node_host_mounts(volumes: Volumes) -> None:
    """`iop-init --bundle node-c`: a tar in deploy/node-host/'s layout, for a new node."""
    assert volumes.run(*node_args(NODES)).returncode == 0
    result = volumes.run("--bundle", "node-c")
    assert result.returncode == 0, result.stderr.decode()
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
        members = {member.name: member for member in archive.getmembers()}
        for name, member in members.items():
            handle = archive.extractfile(member)
            assert handle is not None, f"{name} is not a regular file"
            files[name] = handle.read()
    assert {name: member.mode for name, member in members.items()} == {
        "certs/ca.pem": 0o644,
        "certs/node.pem": 0o644,
        "certs/node.key": 0o600,
        "node.token": 0o600,
    }
    assert {member.uid for member in members.values()} == {os.getuid()}  # the --user given
    cert = x509.load_pem_x509_certificate(files["certs/node.pem"])
    assert subject(cert, NameOID.COMMON_NAME) == "node-c"
    assert subject(cert, NameOID.ORGANIZATIONAL_UNIT_NAME) == "node"
    assert files["certs/ca.pem"] == (volumes.certs / "ca.pem").read_bytes()
    assert files["node.token"].decode().startswith("iopnt_")
    assert volumes.live_tokens()["node-c"] == 1
    # The same paths as the node-host compose file's defaults and its node.yaml.
    node_host = (ROOT / "deploy" / "node-host" / "docker-compose.node.yml").read_text()
    assert "${NODE_CERTS_DIR:-./certs}:/certs:ro" in node_host
    assert "${NODE_TOKEN_FILE:-./node.token}:/etc/iop/node.token:ro" in node_host
    node_yaml = yaml.safe_load((ROOT / "deploy" / "node-host" / "node.yaml").read_text())
    assert node_yaml["tls"]["cert_file"] == "/certs/node.pem"
    assert node_yaml["tls"]["key_file"] == "/certs/node.key"
    assert node_yaml["token_file"] == "/etc/iop/node.token"


def test_init_as_root_hands_everything_to_the_services_user() -> None:
    """What the container does: start as root, chown the volumes, drop to uid 10001."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the init container starts as root)")
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import iop_control_plane, cryptography"],
            user=10001,
            group=10001,
            extra_groups=[],
            capture_output=True,
            check=False,
        )
    except OSError:
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip("the test interpreter or its packages are not readable by uid 10001")
    # Under /tmp itself: uid 10001 cannot reach into pytest's private tmp_path.
    root = Path(tempfile.mkdtemp(prefix="iop-init-test-", dir="/tmp"))
    root.chmod(0o755)
    try:
        volumes = Volumes(root)
        result = volumes.run(*node_args(["node-a"]), user="10001:10001")
        assert result.returncode == 0, result.stderr.decode()
        for directory in (volumes.pki, volumes.certs, volumes.tokens, volumes.database.parent):
            for path in (directory, *directory.iterdir()):
                assert (path.stat().st_uid, path.stat().st_gid) == (10001, 10001), path
    finally:
        shutil.rmtree(root)
