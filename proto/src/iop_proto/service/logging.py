"""loguru set-up: human lines by default, JSON lines (one object per record) on request.

Tracebacks never show variable values (loguru's ``diagnose``): they would copy request
bodies and credentials into the log, and a deep structure many times over. An
unexpected error on a request path is logged with ``log_unexpected``: once, its
traceback cut to ``MAX_TRACEBACK_CHARS``, so no request can write hundreds of KB.

Every line passes ``redaction`` on its way out (a key or token that slipped into a
message or a traceback is rewritten), and the standard library's records (aiohttp's,
asyncio's) come through loguru too (``stdlib_bridge``), so they are redacted, and
formatted, like the rest.
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Final

from loguru import logger

from iop_proto.service.redaction import RedactingStream
from iop_proto.service.settings import LogSettings
from iop_proto.service.stdlib_bridge import install_stdlib_bridge

if TYPE_CHECKING:
    from loguru import Record

_HUMAN_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "<cyan>{extra[service]}</cyan> {message}"
)
_TRACED = " <dim>[trace {extra[trace_id]}]</dim>"
_TRACED_RUN = " <dim>[run {extra[run_id]} trace {extra[trace_id]}]</dim>"


def _human_format(record: Record) -> str:
    """A line of a traced request (``iop_proto.tracing``) names its trace id, and its run
    id where the line's context knows it (the node's)."""
    extra = record["extra"]
    if "trace_id" not in extra:
        return _HUMAN_FORMAT + "\n{exception}"
    return _HUMAN_FORMAT + (_TRACED_RUN if "run_id" in extra else _TRACED) + "\n{exception}"


def configure_logging(service: str, settings: LogSettings) -> None:
    """Replace loguru's default sink; called once, from a service's ``__main__``."""
    logger.remove()
    logger.configure(extra={"service": service})
    sink = RedactingStream(sys.stderr)
    if settings.json_format:
        logger.add(
            sink,
            level=settings.level,
            serialize=True,
            enqueue=False,
            backtrace=False,
            diagnose=False,
        )
    else:
        logger.add(
            sink,
            level=settings.level,
            format=_human_format,
            colorize=sys.stderr.isatty(),
            enqueue=False,
            backtrace=False,
            diagnose=False,
        )
    install_stdlib_bridge()


MAX_TRACEBACK_CHARS: Final = 8 * 1024
"""Enough for any real traceback's story (where it started, where it failed); a longer
one is cut in the middle."""


def log_unexpected(exc: BaseException, message: str, *args: object) -> None:
    """Log an unexpected error (a bug) once, at ERROR, with its traceback bounded.

    ``message`` is a loguru format string for ``args``; the exception's own text
    is never formatted, so braces in it are harmless.
    """
    logger.opt(depth=1).error(message + "\n{}", *args, bounded_traceback(exc))


def bounded_traceback(exc: BaseException, limit: int = MAX_TRACEBACK_CHARS) -> str:
    """``exc``'s traceback (with its causes), at most about ``limit`` characters: its
    start and its end, where a pathological one (a thousand frames, a message quoting
    a whole body) is cut."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n... ({len(text) - limit} characters cut) ...\n{text[-tail:]}"
