"""TLS contexts that pick up new certificate files without a restart: CA rotation without a cut.

A CA is rotated in three steps (docs/deploy-bare-metal.md, "Rotating the CA"): every
service's ``ca_file`` becomes a bundle of the old and the new CA; each service gets a
certificate of the new CA, one at a time; the old CA leaves the bundles. Each step
replaces files under running services. A service reading its files only at start would
need a restart per step, and the edge's restart fails the requests it holds; so every
context made here looks at its three files' stamps (inode, size and mtime, one ``stat``
each) when a connection's handshake begins, and loads them again when one changed.

What it changes: connections made after the change (a new node link, a reconnect).
Links already up stay up: their peers were verified when they connected. A set of files
that does not load (the certificate written, its key not yet) keeps the previous context
and is tried again at the next handshake, so a half-done copy never breaks a listener.

asyncio's TLS transports make each connection's ``SSLObject`` through
``SSLContext.wrap_bio``: that is the one call delegated to the freshest context.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from iop_proto.errors import TlsConfigError

Stamp = tuple[tuple[int, int, int], ...]
_MISSING = (-1, -1, -1)


def _stamp(files: tuple[Path, ...]) -> Stamp:
    stamps = []
    for path in files:
        try:
            status = os.stat(path)
        except OSError:
            stamps.append(_MISSING)  # missing for now (being replaced): nothing to load yet
        else:
            # the inode too: a file renamed into place within one tick of the clock that
            # stamps mtimes, with the same size (a certificate of another CA), still differs
            stamps.append((status.st_ino, status.st_mtime_ns, status.st_size))
    return tuple(stamps)


class ReloadingContext(ssl.SSLContext):
    """An ``SSLContext`` loaded from files, whose connections use the files' current contents.

    Itself loaded at start (so its settings are what a caller inspects); each
    ``wrap_bio`` first checks the files and, when they changed, makes a new context with
    ``build`` and hands the connection to it.
    """

    _files: tuple[Path, ...]
    _build: Callable[[], ssl.SSLContext]
    _stamp_seen: Stamp
    _current: ssl.SSLContext | None

    def __new__(
        cls, protocol: int, files: tuple[Path, ...], build: Callable[[], ssl.SSLContext]
    ) -> ReloadingContext:
        return super().__new__(cls, protocol)

    def __init__(
        self, protocol: int, files: tuple[Path, ...], build: Callable[[], ssl.SSLContext]
    ) -> None:
        self._files = files
        self._build = build
        self._stamp_seen = _stamp(files)
        self._current = None  # None: this context itself

    def current(self) -> ssl.SSLContext:
        """The context for a connection starting now (files loaded again if they changed)."""
        stamp = _stamp(self._files)
        if stamp != self._stamp_seen and _MISSING not in stamp:
            try:
                fresh = self._build()
            except TlsConfigError as exc:
                logger.warning("TLS files changed but do not load yet; keeping the last: {}", exc)
            else:
                logger.info("TLS files changed: loaded {}", ", ".join(map(str, self._files)))
                self._current = fresh
                self._stamp_seen = stamp
        return self if self._current is None else self._current

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        context = self.current()
        if context is self:
            return super().wrap_bio(*args, **kwargs)
        return context.wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        context = self.current()
        if context is self:
            return super().wrap_socket(*args, **kwargs)
        return context.wrap_socket(*args, **kwargs)
