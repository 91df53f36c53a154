"""Backups of a service's state, and their restore (docs/backup.md).

Each service names what it keeps (``StateFile``: a SQLite file with the schema version
this release understands, and the directory of contents beside it, if any); this
package copies them consistently while the service runs and puts them back, and the
PostgreSQL store through PostgreSQL's own tools. The services' console scripts add the
``backup PATH`` / ``restore PATH`` commands through ``add_backup_commands``.
"""

from iop_proto.backup.archive import (
    Manifest,
    ServiceState,
    StateFile,
    make_backup,
    restore_backup,
)
from iop_proto.backup.commands import (
    add_backup_commands,
    is_backup_command,
    run_backup_command,
    service_main,
)
from iop_proto.backup.errors import BackupError

__all__ = [
    "BackupError",
    "Manifest",
    "ServiceState",
    "StateFile",
    "add_backup_commands",
    "is_backup_command",
    "make_backup",
    "restore_backup",
    "run_backup_command",
    "service_main",
]
