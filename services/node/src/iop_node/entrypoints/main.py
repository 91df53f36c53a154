"""The `iop-node` console script: the server, and ``backup PATH`` / ``restore PATH``."""

from __future__ import annotations

from iop_node import __version__
from iop_node.adapters.backup_state import node_state
from iop_node.bootstrap import build
from iop_node.settings import NodeSettings
from iop_proto.backup import service_main


def main(argv: list[str] | None = None) -> int:
    return service_main("node", __version__, NodeSettings, build, node_state, argv)


if __name__ == "__main__":
    raise SystemExit(main())
