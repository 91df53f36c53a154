"""Runtime controls and their audit trail in the PostgreSQL credential store
(docs/ARCHITECTURE.md#runtime-control): their statements, apart from the credentials'
(their tables are the store's migration step 4). ``PostgresCredentialStore`` delegates to
it on its own pool; ``reachable`` turns a lost server into ``StorageUnavailable``."""

from __future__ import annotations

from typing import Any

import asyncpg

from iop_control_plane.domain.controls import Control, ControlChange
from iop_control_plane.domain.credentials import as_utc
from iop_proto.postgres import reachable


class PostgresControls:
    """The three store methods of runtime control over one asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def _fetch(self, what: str, sql: str, *args: Any) -> list[asyncpg.Record]:
        with reachable(what):
            return list(await self._pool.fetch(sql, *args))

    async def runtime_controls(self) -> list[Control]:
        rows = await self._fetch(
            "reading runtime controls",
            "SELECT kind, target, value, change_id, changed_by, changed_at, reason"
            " FROM cp_runtime_controls ORDER BY kind, target",
        )
        return [
            Control(
                row["kind"],
                row["target"],
                row["value"],
                row["change_id"],
                row["changed_by"],
                row["changed_at"],
                row["reason"],
            )
            for row in rows
        ]

    async def control_audit(self, limit: int, change_id: str = "") -> list[ControlChange]:
        rows = await self._fetch(
            "reading the runtime control audit",
            "SELECT * FROM cp_runtime_control_audit WHERE ($1 = '' OR change_id = $1)"
            " ORDER BY at DESC, change_id LIMIT $2",
            change_id,
            limit,
        )
        return [
            ControlChange(
                change_id=row["change_id"],
                at=row["at"],
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
        """As the SQLite store's: compare and set, one transaction. The table lock orders
        the control-planes' changes (rare, an operator's), so two never both pass the
        check over a row that does not exist yet."""
        control = change.applied()
        with reachable("storing a runtime control"):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("LOCK TABLE cp_runtime_controls IN SHARE ROW EXCLUSIVE MODE")
                current = await conn.fetchval(
                    "SELECT value FROM cp_runtime_controls WHERE kind = $1 AND target = $2",
                    change.kind,
                    change.target,
                )
                if (current or "") != change.before:
                    return False
                if control is None:
                    await conn.execute(
                        "DELETE FROM cp_runtime_controls WHERE kind = $1 AND target = $2",
                        change.kind,
                        change.target,
                    )
                else:
                    await conn.execute(
                        "INSERT INTO cp_runtime_controls (kind, target, value, change_id,"
                        " changed_by, changed_at, reason) VALUES ($1, $2, $3, $4, $5, $6, $7)"
                        " ON CONFLICT (kind, target) DO UPDATE SET value = EXCLUDED.value,"
                        " change_id = EXCLUDED.change_id, changed_by = EXCLUDED.changed_by,"
                        " changed_at = EXCLUDED.changed_at, reason = EXCLUDED.reason",
                        control.kind,
                        control.target,
                        control.value,
                        control.change_id,
                        control.changed_by,
                        as_utc(control.changed_at),
                        control.reason,
                    )
                await conn.execute(
                    "INSERT INTO cp_runtime_control_audit (change_id, at, changed_by, kind,"
                    " target, before_value, after_value, reason, reverts)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    change.change_id,
                    as_utc(change.at),
                    change.changed_by,
                    change.kind,
                    change.target,
                    change.before,
                    change.after,
                    change.reason,
                    change.reverts,
                )
        return True
