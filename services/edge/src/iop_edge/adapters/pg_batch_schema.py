"""The PostgreSQL batch store's schema: the same rows as SQLite's (``batch_schema``), plus
the file contents as chunks (``pg_batch_files``).

Applied by ``iop_proto.postgres.apply_migrations`` under the component name
``edge-batches``: each step runs once, in order, under an advisory lock, so
several edges starting at once migrate once. Add a step to change a table;
never edit a released one.

Why the columns are what they are: ``batches.seq`` and ``files.seq`` are the
insertion order SQLite's ``seq``/``rowid`` give (lists and cursors page by
them); ``metadata`` and ``errors`` stay JSON text so ``batch_rows`` maps a row
of either backend; ``lease_expires_at`` is a float like the clock that sets it;
``lease_edge`` is the edge that granted the lease (a worker that registers again
with one edge frees only the leases that edge granted it).
"""

from __future__ import annotations

from typing import Final

COMPONENT: Final = "edge-batches"

_V1: Final = """
CREATE TABLE edge_files (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id          TEXT PRIMARY KEY,
    filename    TEXT NOT NULL,
    purpose     TEXT NOT NULL,
    bytes       BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    owner       TEXT
);
CREATE INDEX edge_files_owner ON edge_files (owner, seq);
CREATE INDEX edge_files_created ON edge_files (created_at);

-- A content outlives its file row for a while (``state`` 'deleted'), so a download in
-- progress reads to its end; 'uploading' is a content whose upload has not committed.
CREATE TABLE edge_file_contents (
    file_id     TEXT PRIMARY KEY,
    state       TEXT NOT NULL CHECK (state IN ('uploading', 'stored', 'deleted')),
    touched_at  DOUBLE PRECISION NOT NULL
);
CREATE INDEX edge_file_contents_state ON edge_file_contents (state, touched_at);

CREATE TABLE edge_file_chunks (
    file_id     TEXT NOT NULL REFERENCES edge_file_contents (file_id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    data        BYTEA NOT NULL,
    PRIMARY KEY (file_id, seq)
);

CREATE TABLE edge_batches (
    seq               BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id                TEXT PRIMARY KEY,
    input_file_id     TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata          TEXT,
    status            TEXT NOT NULL,
    created_at        BIGINT NOT NULL,
    in_progress_at    BIGINT,
    finalizing_at     BIGINT,
    completed_at      BIGINT,
    failed_at         BIGINT,
    expired_at        BIGINT,
    cancelling_at     BIGINT,
    cancelled_at      BIGINT,
    expires_at        BIGINT NOT NULL,
    output_file_id    TEXT,
    error_file_id     TEXT,
    errors            TEXT,
    total_lines       INTEGER NOT NULL,
    lease_id          TEXT UNIQUE,
    lease_owner       TEXT,
    lease_edge        TEXT,
    lease_expires_at  DOUBLE PRECISION,
    finalize_as       TEXT,
    owner             TEXT
);
CREATE INDEX edge_batches_status ON edge_batches (status, seq);
CREATE INDEX edge_batches_owner ON edge_batches (owner, seq);
CREATE INDEX edge_batches_lease_owner ON edge_batches (lease_owner, lease_edge);

CREATE TABLE edge_batch_lines (
    batch_id     TEXT NOT NULL,
    line_number  INTEGER NOT NULL,
    custom_id    TEXT NOT NULL,
    body         TEXT NOT NULL,
    state        TEXT NOT NULL,
    status_code  INTEGER,
    response     TEXT,
    error        TEXT,
    request_id   TEXT,
    result_id    TEXT,
    finished_at  BIGINT,
    PRIMARY KEY (batch_id, line_number)
);
CREATE INDEX edge_batch_lines_state ON edge_batch_lines (batch_id, state, line_number);
"""

STEPS: Final = (_V1,)
"""The schema's versions, in order (``iop_schema_versions`` holds how many ran)."""
