"""The `iop-control-plane` console script."""

from __future__ import annotations

from iop_control_plane import __version__
from iop_control_plane.bootstrap import build
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("control-plane", __version__, ControlPlaneSettings, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
