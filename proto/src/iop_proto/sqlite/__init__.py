"""SQLite the way every IOP service keeps state: one opener, one batched writer.

``files`` opens a file owner-only, versioned and in WAL mode; ``writer`` queues
records in memory and commits them in batches from one task. A service keeps
only its schema, its record mapping and its queries.
"""

from iop_proto.sqlite.files import (
    Migration,
    open_database,
    prepare_file,
    statement_migrations,
    transaction,
)
from iop_proto.sqlite.writer import BatchedWriter, QueuedWriter, WriterTuning

__all__ = [
    "BatchedWriter",
    "Migration",
    "QueuedWriter",
    "WriterTuning",
    "open_database",
    "prepare_file",
    "statement_migrations",
    "transaction",
]
