"""What the control-plane keeps about nodes beyond their tokens: retirement and connection state.

A retired node is out of the fleet however the fleet file reads: the served snapshot leaves
out its providers, the edges drop its connection, and its registration is refused (even
with a new token) until ``node add`` admits it again. Retirement lives in the database,
not in the fleet file, so the command never rewrites the operator's commented YAML; the
file should still lose the node, and ``node list`` says when it has not.

The connection state comes from where it is known: each edge reports the nodes connected
to it over its control link (``NodeStatusReport``), and the control-plane keeps the last
report per node, so ``node list`` works from the database alone, also while the server is
down (then it is the last state reported, with its time).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from datetime import datetime

from iop_control_plane.domain.fleet import FleetSpec


@dataclass(frozen=True, slots=True)
class NodeState:
    """The last state an edge reported of one node's connection."""

    node_id: str
    edge_id: str
    connected: bool
    token_id: str
    since: datetime | None
    peer_address: str
    detail: str
    reported_at: datetime


def unserved_models(fleet: FleetSpec, retired: Container[str]) -> list[str]:
    """The fleet's models each of whose providers is on a retired node: the catalog shows
    them with no provider until the fleet file gives them one or drops them."""

    def served(provider_id: str) -> bool:
        found = fleet.provider(provider_id)
        return found is not None and found[0].id not in retired

    return [model.id for model in fleet.models if not any(map(served, model.providers))]
