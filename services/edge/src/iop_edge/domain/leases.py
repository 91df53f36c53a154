"""What the edge answers a batch worker, as plain values (the worker session converts
them to the wire's ``LeaseGrant`` and ``BatchLineResult``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A batch leased to a worker; all empty (``batch_id == ""``) when none needs work."""

    batch_id: str = ""
    lease_id: str = ""
    expires_at_unix_ms: int = 0
    endpoint: str = ""
    next_line: int = 0
    total_lines: int = 0


@dataclass(frozen=True, slots=True)
class LineReply:
    """One batch line's outcome, as the worker is told it."""

    lease_id: str = ""
    line_number: int = 0
    custom_id: str = ""
    status_code: int = 0
    response_json: bytes = b""
    error_json: bytes = b""
