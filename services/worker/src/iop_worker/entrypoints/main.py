"""The `iop-worker` console script."""

from __future__ import annotations

from iop_proto.service import run_service
from iop_worker import __version__
from iop_worker.bootstrap import build
from iop_worker.settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    return run_service("worker", __version__, WorkerSettings, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
