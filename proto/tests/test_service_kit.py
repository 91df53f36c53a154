"""The boot kit: settings with env overrides and named errors, admin port, ordered teardown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from iop_proto.errors import SettingsError
from iop_proto.service import AdminServer, DrainingSettings, ServiceSettings, load_settings
from iop_proto.service.runner import EXIT_BAD_SETTINGS, run_service, serve

CONFIG = """\
service_id: svc-1
admin:
  host: 127.0.0.1
  port: 0
log:
  level: DEBUG
tls:
  enabled: false
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "svc.yaml"
    path.write_text(CONFIG)
    return path


def test_file_values_are_loaded(config_file: Path) -> None:
    settings = load_settings(ServiceSettings, config_file)
    assert settings.service_id == "svc-1"
    assert settings.log.level == "DEBUG"
    assert not settings.tls.enabled


def test_environment_overrides_nested_keys(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_ADMIN__PORT", "9555")
    monkeypatch.setenv("IOP_LOG__JSON", "true")
    settings = load_settings(ServiceSettings, config_file)
    assert settings.admin.port == 9555
    assert settings.admin.host == "127.0.0.1"  # the rest of the section stays
    assert settings.log.json_format is True


def test_a_draining_service_keeps_its_reserve_below_the_timeout(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edge, node and worker drain for shutdown_timeout_s minus shutdown_reserve_s."""
    assert load_settings(DrainingSettings, config_file).drain_s == 10 - 2  # the defaults
    monkeypatch.setenv("IOP_SHUTDOWN_TIMEOUT_S", "2")
    monkeypatch.setenv("IOP_SHUTDOWN_RESERVE_S", "2")
    with pytest.raises(SettingsError, match="shutdown_reserve_s"):
        load_settings(DrainingSettings, config_file)


def test_bad_value_names_the_field_and_the_file(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_ADMIN__PORT", "99999")
    with pytest.raises(SettingsError) as info:
        load_settings(ServiceSettings, config_file)
    message = str(info.value)
    assert str(config_file) in message
    assert "admin.port" in message
    assert "IOP_ADMIN__PORT" in message


def test_unknown_key_is_refused(config_file: Path) -> None:
    config_file.write_text(CONFIG + "admin_port: 1\n")
    with pytest.raises(SettingsError, match="admin_port"):
        load_settings(ServiceSettings, config_file)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(ServiceSettings, tmp_path / "nope.yaml")


def test_settings_are_frozen(config_file: Path) -> None:
    settings = load_settings(ServiceSettings, config_file)
    with pytest.raises(ValueError, match="frozen"):
        settings.service_id = "other"  # type: ignore[misc]


def test_run_service_exits_2_on_bad_settings(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file.write_text(CONFIG.replace("level: DEBUG", "level: LOUD"))

    @contextlib.asynccontextmanager
    async def never_built(
        settings: ServiceSettings, registry: CollectorRegistry, admin: AdminServer
    ) -> AsyncIterator[None]:
        raise AssertionError("a service with bad settings must not be built")
        yield

    code = run_service("svc", "0.0.0", ServiceSettings, never_built, ["--config", str(config_file)])
    assert code == EXIT_BAD_SETTINGS
    err = capsys.readouterr().err
    assert "log.level" in err
    assert "LOUD" in err


async def test_serve_runs_until_stop_then_tears_down_in_reverse(config_file: Path) -> None:
    settings = load_settings(ServiceSettings, config_file)
    events: list[str] = []
    stop = asyncio.Event()
    admin_seen: list[AdminServer] = []
    built = asyncio.Event()

    @contextlib.asynccontextmanager
    async def build(
        s: ServiceSettings, registry: CollectorRegistry, admin: AdminServer
    ) -> AsyncIterator[None]:
        admin_seen.append(admin)
        built.set()
        events.append("service started")
        try:
            yield
        finally:
            events.append("service stopped")

    task = asyncio.create_task(serve("svc", "1.2.3", settings, build, stop))
    await asyncio.wait_for(built.wait(), 5)
    admin = admin_seen[0]
    await asyncio.wait_for(admin.started.wait(), 5)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{admin.port}/healthz") as response:
            assert response.status == 200
            assert await response.json() == {"status": "ok", "service": "svc"}
        async with http.get(f"http://127.0.0.1:{admin.port}/readyz") as response:
            assert response.status == 200
        async with http.get(f"http://127.0.0.1:{admin.port}/metrics") as response:
            text = await response.text()
            assert 'iop_build_info{service="svc",service_id="svc-1",version="1.2.3"} 1.0' in text
    assert events == ["service started"]
    stop.set()
    await asyncio.wait_for(task, 5)
    assert events == ["service started", "service stopped"]
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as http:
            await http.get(f"http://127.0.0.1:{admin.port}/healthz")


async def test_readiness_check_reports_the_reason() -> None:
    reason: list[str | None] = ["waiting for the control-plane"]
    admin = AdminServer(
        "svc", CollectorRegistry(), host="127.0.0.1", port=0, readiness=lambda: reason[0]
    )
    port = await admin.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == "waiting for the control-plane"
            reason[0] = None
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 200
    finally:
        await admin.close()


async def test_readiness_names_the_bound_listening_ports() -> None:
    """A service started with port 0 tells where it listens (tests read the ports back)."""
    admin = AdminServer("svc", CollectorRegistry(), host="127.0.0.1", port=0, readiness=lambda: "x")
    admin.report_port("http", 40123)
    port = await admin.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 503  # not ready yet, and still it says where
                assert (await response.json())["ports"] == {"http": 40123}
    finally:
        await admin.close()
