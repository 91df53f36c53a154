"""Runtime controls and their audit trail in the SQLite credential store
(docs/ARCHITECTURE.md#runtime-control): the store's tables and statements for them, apart
from the credentials'. ``SqliteCredentialStore`` delegates to it on its own connection."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

import aiosqlite

from iop_control_plane.domain.controls import Control, ControlChange
from iop_control_plane.domain.credentials import as_utc

CONTROL_TABLES = (
    """CREATE TABLE IF NOT EXISTS runtime_controls (
        kind       TEXT NOT NULL,
        target     TEXT NOT NULL,
        value      TEXT NOT NULL,
        change_id  TEXT NOT NULL,
        changed_by TEXT NOT NULL,
        changed_at TEXT NOT NULL,
        reason     TEXT NOT NULL,
        PRIMARY KEY (kind, target)
    )""",
    """CREATE TABLE IF NOT EXISTS runtime_control_audit (
        change_id    TEXT PRIMARY KEY,
        at           TEXT NOT NULL,
        changed_by   TEXT NOT NULL,
        kind         TEXT NOT NULL,
        target       TEXT NOT NULL,
        before_value TEXT NOT NULL,
        after_value  TEXT NOT NULL,
        reason       TEXT NOT NULL,
        reverts      TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS runtime_control_audit_at ON runtime_control_audit (at)",
)
"""Runtime controls in force and the audit trail of their changes (domain.controls)."""


def _to_text(moment: datetime) -> str:
    # As the credential store's: fixed width, so text order is time order.
    return as_utc(moment).isoformat(timespec="microseconds")


class SqliteControls:
    """The three store methods of runtime control over one aiosqlite connection."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def _fetch(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return list(await self._db.execute_fetchall(sql, parameters))

    async def runtime_controls(self) -> list[Control]:
        rows = await self._fetch(
            "SELECT kind, target, value, change_id, changed_by, changed_at, reason"
            " FROM runtime_controls ORDER BY kind, target"
        )
        return [
            Control(
                row["kind"],
                row["target"],
                row["value"],
                row["change_id"],
                row["changed_by"],
                datetime.fromisoformat(row["changed_at"]),
                row["reason"],
            )
            for row in rows
        ]

    async def control_audit(self, limit: int, change_id: str = "") -> list[ControlChange]:
        rows = await self._fetch(
            "SELECT * FROM runtime_control_audit WHERE (? = '' OR change_id = ?)"
            " ORDER BY at DESC, change_id LIMIT ?",
            (change_id, change_id, limit),
        )
        return [
            ControlChange(
                change_id=row["change_id"],
                at=datetime.fromisoformat(row["at"]),
                changed_by=row["changed_by"],
                kind=row["kind"],
                target=row["target"],
                before=row["before_value"],
                after=row["after_value"],
                reason=row["reason"],
                reverts=row["reverts"],
            )
            for row in rows
        ]

    async def record_control_change(self, change: ControlChange) -> bool:
        """The control and its audit entry in one transaction, only over ``change.before``
        (compare and set: a change raced by another's is refused, never lost unseen).

        Another coroutine's statement may fall inside the transaction (the connection is
        shared): it is committed with it, which harms nothing, and nothing is rolled back
        but on an error.
        """
        await self._run("BEGIN IMMEDIATE")
        try:
            rows = await self._fetch(
                "SELECT value FROM runtime_controls WHERE kind = ? AND target = ?",
                (change.kind, change.target),
            )
            if (rows[0]["value"] if rows else "") != change.before:
                await self._run("COMMIT")
                return False
            control = change.applied()
            if control is None:
                await self._run(
                    "DELETE FROM runtime_controls WHERE kind = ? AND target = ?",
                    (change.kind, change.target),
                )
            else:
                await self._run(
                    "INSERT OR REPLACE INTO runtime_controls (kind, target, value, change_id,"
                    " changed_by, changed_at, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        control.kind,
                        control.target,
                        control.value,
                        control.change_id,
                        control.changed_by,
                        _to_text(control.changed_at),
                        control.reason,
                    ),
                )
            await self._run(
                "INSERT INTO runtime_control_audit (change_id, at, changed_by, kind, target,"
                " before_value, after_value, reason, reverts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    change.change_id,
                    _to_text(change.at),
                    change.changed_by,
                    change.kind,
                    change.target,
                    change.before,
                    change.after,
                    change.reason,
                    change.reverts,
                ),
            )
            await self._run("COMMIT")
        except BaseException:
            await self._run("ROLLBACK")
            raise
        return True

    async def _run(self, sql: str, parameters: tuple[Any, ...] = ()) -> None:
        async with self._db.execute(sql, parameters):
            pass
