"""The node settings file ``node add`` writes: complete, with the node host's paths.

The operator saves it as the node's ``/etc/iop/node.yaml`` as it is, so every path in
it is where docs/deploy-bare-metal.md puts the file on the node's host (not where it is
on this one): the certificates and the token in ``/etc/iop/certs/``, the run history in
the unit's ``StateDirectory``. Prose goes into ``#`` comments only, so what is printed
is YAML from its first line to its last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from iop_control_plane.domain.fleet import NodeSpec
from iop_proto.tls_explain import is_address

NODE_CERTS_DIR = Path("/etc/iop/certs")  # the guide's layout on a node's host
NODE_HISTORY_DB = Path("/var/lib/iop/node/history.db")  # deploy/systemd/iop-node.service
NODE_ADMIN_PORT = 9102  # configs/node.yaml
EDGE_PLACEHOLDER = "EDGE_HOST"  # without --edge: the control-plane cannot know it
DEFAULT_EDGE_PORT = 7000  # the edge's node_listener port in configs/edge.yaml
_PROG = "iop-control-plane"


@dataclass(frozen=True, slots=True)
class NodeHostPaths:
    """Where the node's files are on the node's host."""

    certs_dir: Path = NODE_CERTS_DIR
    token_file: Path | None = None  # default: certs_dir/ID.token, beside the key

    def token(self, node_id: str) -> Path:
        return self.token_file or self.certs_dir / f"{node_id}.token"


def node_settings(
    node_id: str, edge: tuple[str, int] | None, paths: NodeHostPaths
) -> dict[str, Any]:
    """The node's settings (``iop_node.settings.NodeSettings``), with the node host's paths."""
    certs = paths.certs_dir
    host, port = edge or (EDGE_PLACEHOLDER, DEFAULT_EDGE_PORT)
    return {
        "service_id": node_id,
        "admin": {"host": "127.0.0.1", "port": NODE_ADMIN_PORT},
        "tls": {
            "enabled": True,
            "ca_file": str(certs / "ca.pem"),
            "cert_file": str(certs / f"{node_id}.pem"),
            "key_file": str(certs / f"{node_id}.key"),
        },
        "edge": {"host": host, "port": port},
        "token_file": str(paths.token(node_id)),
        "history_db": str(NODE_HISTORY_DB),
    }


def render(
    settings: dict[str, Any],
    *,
    issued_at: datetime,
    fleet_file: Path,
    node: NodeSpec | None,
) -> str:
    """``settings`` as the YAML file to save, with what to check around it as comments."""
    node_id, host = settings["service_id"], settings["edge"]["host"]
    lines = [
        f"# Settings of IOP node {node_id}: `{_PROG} node add {node_id}`, "
        f"{issued_at:%Y-%m-%d %H:%M}Z.",
        "# Save as /etc/iop/node.yaml on the node's host; configs/node.yaml explains every key.",
    ]
    if host == EDGE_PLACEHOLDER:
        lines.append(
            f"# {EDGE_PLACEHOLDER}: where the node dials the edge (node add --edge sets it)"
        )
    elif is_address(host):
        lines += [
            f"# The edge's certificate must carry IP:{host} (devcerts --san edge=IP:{host}),",
            "# or edge.server_name be set to a name it carries.",
        ]
    lines.append(yaml.safe_dump(settings, sort_keys=False).rstrip())
    lines += _providers_comment(node_id, fleet_file, node)
    return "\n".join(lines) + "\n"


def _providers_comment(node_id: str, fleet_file: Path, node: NodeSpec | None) -> list[str]:
    """Providers are not node settings: the control-plane sends them from the fleet file."""
    lines = [f"# Providers: the control-plane sends them from its fleet file ({fleet_file})."]
    if node is not None:
        listed = ", ".join(f"{p.id} ({p.type})" for p in node.providers) or "none yet"
        return [*lines, f"# It lists {node_id} with: {listed}."]
    example: Sequence[str] = (
        f"  - id: {node_id}",
        "    providers:",
        f"      - id: {node_id}-mock",
        "        type: mock",
        "        category: local_inference",
        "        models: [mock-small]",
    )
    return [
        *lines,
        f"# It does not list {node_id} yet: add it under nodes: (and each provider under a",
        f"# model's providers), then `{_PROG} config reload`, e.g.",
        *(f"#{line}" for line in example),
    ]
