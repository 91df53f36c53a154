"""The `iop-node` console script."""

from __future__ import annotations

from iop_node import __version__
from iop_node.bootstrap import build
from iop_node.settings import NodeSettings
from iop_proto.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("node", __version__, NodeSettings, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
