"""The backup package's errors."""

from __future__ import annotations

from iop_proto.errors import IopError


class BackupError(IopError):
    """A backup or restore that cannot be done as asked; nothing was changed."""
