"""What a provider runs on, for qualification reports (docs/ARCHITECTURE.md#qualification-reports).

The engine says its name and version (``EngineReporter``); the device is what the
engine says, else this node's host CPU, named as such: a node usually runs beside its
engine, and where it does not the report still says whose CPU it names. Asked when a
provider becomes available (at start, and again after it was down: an engine upgrade
restarts it), never per request.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import platform
from pathlib import Path

from iop_node.ports import EngineInfo, EngineReporter

CPUINFO = Path("/proc/cpuinfo")


async def describe(adapter: object, provider_type: str) -> EngineInfo:
    """The adapter's engine (``provider_type`` alone when it cannot ask), its device
    filled in with this host's CPU when the engine did not name one. Never raises for
    an engine that does not answer: a report then shows an empty version."""
    info = EngineInfo(provider_type)
    # isinstance checks only that the name exists: an adapter's ``engine`` attribute that
    # is not the method (a test's, a plugin's) is no report of its engine
    if isinstance(adapter, EngineReporter) and inspect.iscoroutinefunction(adapter.engine):
        info = await adapter.engine()
    if info.device:
        return info
    return EngineInfo(info.name, info.version, f"node host CPU: {host_cpu()}")


@functools.cache
def host_cpu() -> str:
    """This host's CPU model and logical core count (read once: it does not change)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in CPUINFO.read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "Model", "Hardware"):
                model = value.strip()
                break
    model = model or platform.processor() or platform.machine() or "unknown"
    return f"{model} ({os.cpu_count() or 0} cores)"
