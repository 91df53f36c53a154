"""deploy/systemd/: what the units promise, checked against the services and systemd itself.

The units are run for real (their ExecStart, in a namespace) by ``make test-multihost``;
here, in plain ``make test``: each starts its package's own console script with the
settings path the guide writes, runs as ``iop``, restarts on failure but not on exit code
2, and that 2 is what a service with a broken configuration really exits with; and
``systemd-analyze verify`` finds nothing to say about them (where systemd is installed).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
SERVICES = ("control-plane", "edge", "node", "worker")
BIN = Path(sys.executable).parent


def service_section(service: str) -> dict[str, list[str]]:
    section, found = "", dict[str, list[str]]()
    for line in (UNITS / f"iop-{service}.service").read_text().splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_one_unit_per_service_and_nothing_else() -> None:
    assert sorted(p.name for p in UNITS.iterdir()) == sorted(f"iop-{s}.service" for s in SERVICES)


@pytest.mark.parametrize("service", SERVICES)
def test_each_unit_runs_its_console_script_as_iop_and_stops_on_a_config_error(
    service: str,
) -> None:
    unit = service_section(service)
    scripts = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())
    assert f"iop-{service}" in scripts["project"]["scripts"]
    assert unit["ExecStart"] == [f"/opt/iop/bin/iop-{service} --config /etc/iop/{service}.yaml"]
    assert unit["User"] == ["iop"]
    assert unit["EnvironmentFile"] == [f"-/etc/iop/{service}.env"]
    assert unit["StateDirectory"] == [f"iop/{service}"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["RestartPreventExitStatus"] == ["2"]
    assert unit["NoNewPrivileges"] == ["yes"]
    assert unit["ProtectSystem"] == ["strict"]


@pytest.mark.parametrize("service", SERVICES)
def test_a_broken_settings_file_exits_2_the_status_the_units_do_not_restart_on(
    service: str, tmp_path: Path
) -> None:
    settings = tmp_path / f"{service}.yaml"
    settings.write_text("no_such_setting: 1\n")
    result = subprocess.run(
        [str(BIN / f"iop-{service}"), "--config", str(settings)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "no_such_setting" in result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd is not installed")
@pytest.mark.parametrize("service", SERVICES)
def test_systemd_finds_nothing_to_say_about_the_unit(service: str, tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this checkout's script.
    text = (UNITS / f"iop-{service}.service").read_text().replace("/opt/iop/bin", str(BIN))
    unit = tmp_path / f"iop-{service}.service"
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""
