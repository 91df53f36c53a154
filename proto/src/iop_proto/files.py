"""Writing credentials and settings files: the mode from the first byte, never half a file.

One implementation for every program that writes a key, a token or a node's settings
(``tools/devcerts.py``, ``deploy/init/iop_init.py``, the control-plane's commands):
each had its own copy of the same exclusive-create / rename-over dance.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_file(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    """Write ``data`` to ``path`` with ``mode``; replace an existing file only when ``force``.

    Without ``force`` the file is created exclusively (``FileExistsError`` otherwise), so
    even a file that appeared since the caller looked is not clobbered: it may hold the
    key, token or settings a running service uses. With ``force`` a temporary file is
    renamed over the old one, so a reader never sees half of it. Either way the mode is
    set on the open file, whatever the umask made of it, before a byte is written.
    """
    if not force:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
