"""loguru set-up: human lines by default, JSON lines (one object per record) on request."""

from __future__ import annotations

import sys

from loguru import logger

from iop_proto.service.settings import LogSettings

_HUMAN_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "<cyan>{extra[service]}</cyan> {message}"
)


def configure_logging(service: str, settings: LogSettings) -> None:
    """Replace loguru's default sink; called once, from a service's ``__main__``."""
    logger.remove()
    logger.configure(extra={"service": service})
    if settings.json_format:
        logger.add(sys.stderr, level=settings.level, serialize=True, enqueue=False)
    else:
        logger.add(
            sys.stderr,
            level=settings.level,
            format=_HUMAN_FORMAT,
            colorize=sys.stderr.isatty(),
            enqueue=False,
        )
