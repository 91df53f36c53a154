"""What the node keeps, for ``iop-node backup`` / ``restore`` (iop_proto.backup): its run
history. Its token and certificates are settings, kept with them."""

from __future__ import annotations

from iop_node import __version__
from iop_node.adapters.sqlite_history import SCHEMA_VERSION
from iop_node.settings import NodeSettings
from iop_proto.backup.archive import ServiceState, StateFile


def node_state(settings: NodeSettings) -> ServiceState:
    return ServiceState(
        "node",
        __version__,
        files=(StateFile("history.db", settings.history_db, SCHEMA_VERSION),),
    )
