"""What the test reads of a systemd unit file the guide installed: the ``[Service]``
section's ``ExecStart`` (an IOP console script and its ``--config``) and the
``EnvironmentFile`` of ``IOP_*`` settings, as systemd would read them."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path


def read_unit(
    root: Path, rewrite: Callable[[str], str], unit: str
) -> tuple[str, Path, dict[str, str]]:
    """The console script, settings file and environment the unit installed under the
    host directory ``root`` starts (``rewrite``: its paths on that host)."""
    path = root / "etc/systemd/system" / f"{unit}.service"
    settings = _unit_service_section(path.read_text())
    argv = shlex.split(rewrite(settings["ExecStart"]))
    script = Path(argv[0])
    assert script.parent == Path(sys.prefix) / "bin", argv
    assert argv[1:2] == ["--config"], argv
    assert len(argv) == 3, argv
    env_file = Path(rewrite(settings.get("EnvironmentFile", "-").lstrip("-")))
    env = _environment_file(env_file.read_text()) if env_file.is_file() else {}
    return script.name, Path(argv[2]), env


def _unit_service_section(text: str) -> dict[str, str]:
    section, found = "", {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found[key] = value
    return found


def _environment_file(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip().strip('"') for k, v in pairs if not k.lstrip().startswith("#")}
