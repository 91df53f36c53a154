"""The last line of defence for secrets in logs: every line a service writes is redacted.

The first line is to never log a secret at all: no code logs a key or token, tracebacks
carry no variable values (``diagnose=False``), and the HTTP parse errors that quote a
request's bytes are logged without them (``stdlib_bridge``). This catches what slips
past those: anything shaped like an IOP API key (``sk-iop-``), a node token (``iopnt_``),
an upstream provider's key (``sk-...``, ``sk-ant-...``) or a bearer credential is
rewritten before the line reaches the sink, whatever code wrote it and in whichever
format (human lines, JSON, a traceback).
"""

from __future__ import annotations

import re
from typing import Final, Protocol

REDACTED: Final = "[redacted]"

_SECRET: Final = re.compile(
    # IOP's API keys and node tokens, and the sk- keys of OpenAI and Anthropic; the
    # look-behind keeps a word that merely ends in "sk" (``task-...``) intact
    r"(?<![A-Za-z0-9_-])(?P<prefix>sk-iop-|iopnt_|sk-)[A-Za-z0-9_-]{8,}"
    # any credential after "Bearer", up to a quote, space or escape
    r"|(?P<scheme>\b[Bb][Ee][Aa][Rr][Ee][Rr](?:\s|\\[rnt])+)[^\s'\"\\,;]{8,}"
)


def redact(text: str) -> str:
    """``text`` with every secret-shaped token replaced by its prefix and ``REDACTED``."""
    return _SECRET.sub(_keep_prefix, text)


def _keep_prefix(match: re.Match[str]) -> str:
    return (match.group("prefix") or match.group("scheme")) + REDACTED


class TextSink(Protocol):
    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


class RedactingStream:
    """A text stream (``sys.stderr``) that redacts what it is given before writing it:
    loguru's sink, so every formatted record passes here, message and traceback alike."""

    def __init__(self, stream: TextSink) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        self._stream.write(redact(text))

    def flush(self) -> None:
        self._stream.flush()
