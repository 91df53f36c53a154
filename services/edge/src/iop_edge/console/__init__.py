"""The operator console: a read-only web page over the edge's catalog and run history
(docs/ARCHITECTURE.md#catalog)."""

from __future__ import annotations

from iop_edge.console.routes import CONSOLE_PATH, add_console_routes

__all__ = ["CONSOLE_PATH", "add_console_routes"]
