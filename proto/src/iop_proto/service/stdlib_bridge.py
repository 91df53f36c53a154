"""The standard library's logging (aiohttp's, asyncio's) into loguru, with HTTP parse errors
cut to one line.

Without a handler, a library's warnings and errors go to Python's last-resort handler:
straight to stderr, past the service's format, its JSON mode and its redaction. And
aiohttp logs every request its parser refuses (bare LF line endings, an obs-folded or
over-long header, a bad method) as "Error handling request" with a traceback, and the
exception's text quotes the raw bytes around the error: the ``Authorization`` header
with the client's key, often. A malformed request is the client's fault and says
nothing about the server: here it becomes one line naming the client and the kind of
error (``BadStatusLine``, ``LineTooLong``...), never its bytes and never a traceback.
"""

from __future__ import annotations

import logging
from typing import Final

from aiohttp.http_exceptions import HttpProcessingError
from loguru import logger

LIBRARY_LEVEL: Final = logging.WARNING
"""What the libraries log below this (asyncio's and aiohttp's debug and info) is noise."""


def install_stdlib_bridge() -> None:
    """Send every standard ``logging`` record at ``LIBRARY_LEVEL`` or above to loguru."""
    logging.basicConfig(handlers=[LoguruBridge()], level=LIBRARY_LEVEL, force=True)


class LoguruBridge(logging.Handler):
    """A ``logging`` handler that writes each record through loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            # aiohttp's "Error handling request from <remote>": the message names the
            # client, the exception's text holds the request's bytes and is dropped
            logger.info(
                "{}: malformed HTTP request refused ({}, {}; its bytes are not logged)",
                _message(record),
                type(error).__name__,
                error.code,
            )
            return
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(exception=record.exc_info or None).log(
            level, "{}: {}", record.name, _message(record)
        )


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):  # a library's format string that does not fit its args
        return str(record.msg)
