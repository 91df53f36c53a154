"""The `iop-edge` console script: the server, and ``backup PATH`` / ``restore PATH``."""

from __future__ import annotations

from iop_edge import __version__
from iop_edge.adapters.backup_state import edge_state
from iop_edge.bootstrap import build
from iop_edge.settings import EdgeSettings
from iop_proto.backup import service_main


def main(argv: list[str] | None = None) -> int:
    return service_main("edge", __version__, EdgeSettings, build, edge_state, argv)


if __name__ == "__main__":
    raise SystemExit(main())
