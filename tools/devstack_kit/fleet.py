"""The fleet: the file the control-plane serves, and which providers "up" waits for."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

import yaml

from .plan import FLEET_COPY, REPO, Options, Plan, control_plane

# A provider endpoint on this machine: `endpoint: http://127.0.0.1:8091` (quotes optional).
LOCAL_ENDPOINT = re.compile(
    r"""^(?P<head>\s*-?\s*endpoint:\s*["']?https?://(?:127\.0\.0\.1|localhost):)(?P<port>\d+)""",
    re.MULTILINE,
)


def fleet_source(plans: Sequence[Plan], fleet: Path | None = None) -> Path:
    """``fleet`` if given, else the fleet file the dev control-plane's settings name
    (relative to the repository)."""
    if fleet is not None:
        return fleet
    cp = control_plane(plans)
    settings = yaml.safe_load(cp.config.read_text()) if cp.config is not None else None
    named = (settings or {}).get("fleet_file")
    if not named:
        raise ValueError(f"{cp.config} names no fleet_file")
    return REPO / str(named)


def shift_endpoints(text: str, offset: int, ports: Collection[int]) -> str:
    """``text`` with every local endpoint on one of ``ports`` moved by ``offset``.

    A textual edit, so the copy keeps the original's comments and layout: with offset 0
    it is the original, byte for byte. Endpoints elsewhere are not ours to move.
    """

    def shift(match: re.Match[str]) -> str:
        port = int(match["port"])
        return match["head"] + str(port + offset if port in ports else port)

    return LOCAL_ENDPOINT.sub(shift, text)


def write_fleet(plans: Sequence[Plan], opts: Options) -> Path:
    """The fleet file the control-plane will read; with an offset, a shifted copy.

    Without an offset the control-plane reads the original, so `config reload` after
    editing configs/fleet.yaml works as the README says.
    """
    source = fleet_source(plans, opts.fleet)
    if not opts.port_offset:
        return source
    ours = {port for plan in plans for port in plan.spec.all_ports().values()}
    copy = opts.state_dir / FLEET_COPY
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(shift_endpoints(source.read_text(), opts.port_offset, ours))
    return copy


def fleet_providers(fleet: Path) -> frozenset[str]:
    """Every provider id under ``nodes[]``: what the catalog must show available."""
    data = yaml.safe_load(fleet.read_text()) or {}
    nodes = data.get("nodes") or []
    return frozenset(str(p["id"]) for node in nodes for p in node.get("providers") or [])
