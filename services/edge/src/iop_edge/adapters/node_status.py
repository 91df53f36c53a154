"""Which nodes are connected to this edge, as the control-plane's `node list` shows them.

The edge is where a node's connection is known, so it reports: the node listener tells
the book of each registration and disconnection, and the book hands a full report
(``NodeStatusReport``: every node seen since the edge started) to its listener, the
control-plane link, which sends it now and again after each reconnection. A full list
rather than a delta, so a report lost with a link costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from iop_proto.v1 import runtime_pb2 as pb

StatusListener = Callable[[pb.NodeStatusReport], None]


class NodeStatusBook:
    """The latest connection state of every node seen by this edge."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._nodes: dict[str, pb.NodeStatus] = {}
        self._listener: StatusListener | None = None

    def subscribe(self, listener: StatusListener) -> None:
        self._listener = listener

    def report(self) -> pb.NodeStatusReport:
        return pb.NodeStatusReport(nodes=list(self._nodes.values()))

    def connected(self, node_id: str, token_id: str, peer_address: str) -> None:
        self._set(pb.NodeStatus(node_id=node_id, connected=True, token_id=token_id,
                                peer_address=peer_address))  # fmt: skip

    def disconnected(self, node_id: str, token_id: str, reason: str) -> None:
        """The node's connection ended (the caller skips one a new connection replaced)."""
        known = self._nodes.get(node_id)
        address = known.peer_address if known is not None else ""
        self._set(pb.NodeStatus(node_id=node_id, connected=False, token_id=token_id,
                                peer_address=address, detail=reason))  # fmt: skip

    def _set(self, status: pb.NodeStatus) -> None:
        status.since_unix_ms = int(self._clock() * 1000)
        self._nodes[status.node_id] = status
        if self._listener is not None:
            self._listener(self.report())
