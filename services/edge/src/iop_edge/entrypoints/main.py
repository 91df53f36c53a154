"""The `iop-edge` console script."""

from __future__ import annotations

from iop_edge import __version__
from iop_edge.bootstrap import build
from iop_edge.settings import EdgeSettings
from iop_proto.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("edge", __version__, EdgeSettings, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
