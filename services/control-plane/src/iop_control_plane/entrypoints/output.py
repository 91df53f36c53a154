"""How the operator's commands print: tables, times, JSON, and secret files.

Shared by the credential commands (``cli``) and the node commands (``node_commands``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from iop_proto.files import write_file


def show_time(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def json_time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]
    return "\n".join(lines)


def print_json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, indent=2), file=out)


def write_secret_file(path: Path, secret: str, *, force: bool) -> None:
    """Write ``secret`` and a newline to ``path``, mode 0600 from its first byte
    (``write_file``)."""
    write_file(path, f"{secret}\n".encode(), 0o600, force=force)
