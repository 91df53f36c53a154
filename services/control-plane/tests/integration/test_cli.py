"""The credential commands against a real SQLite file: a secret is printed once, then never."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from iop_control_plane.domain.credentials import hash_secret
from iop_control_plane.entrypoints.cli import add_commands, run_command
from iop_control_plane.ports import OpenedCredentialStore

TOKEN = re.compile(r"iopnt_[A-Za-z0-9_-]{43}")
KEY = re.compile(r"sk-iop-[A-Za-z0-9_-]{43}")


def _parser() -> argparse.ArgumentParser:
    """The console script's shape: global options, then the sub-commands."""
    parser = argparse.ArgumentParser(prog="iop-control-plane")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


class Run:
    """One command's exit code and what it wrote."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err


class Logs:
    """Every log record, stdlib (aiosqlite's debug lines included) and loguru, at any level,
    and on PostgreSQL what the server logged meanwhile (every statement, with its values)."""

    def __init__(self, caplog: pytest.LogCaptureFixture, server_log: Path | None) -> None:
        self._caplog = caplog
        self._loguru: list[str] = []
        self._server_log = server_log
        self._server_log_start = server_log.stat().st_size if server_log else 0

    def sink(self, message: object) -> None:
        self._loguru.append(str(message))

    def text(self) -> str:
        server = ""
        if self._server_log is not None:
            with self._server_log.open("rb") as log:
                log.seek(self._server_log_start)
                server = log.read().decode(errors="replace")
        return "\n".join([*self._loguru, *(r.getMessage() for r in self._caplog.records), server])


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, server_log: Path | None) -> Iterator[Logs]:
    caplog.set_level(logging.DEBUG)
    captured = Logs(caplog, server_log)
    sink = logger.add(captured.sink, level="TRACE")
    try:
        yield captured
    finally:
        logger.remove(sink)


async def _run(store: OpenedCredentialStore, *argv: str) -> Run:
    out, err = io.StringIO(), io.StringIO()
    code = await run_command(_parser().parse_args(argv), store, out, err)
    return Run(code, out.getvalue(), err.getvalue())


async def test_token_issue_prints_the_secret_once_and_stores_its_hash(
    store: OpenedCredentialStore, logs: Logs
) -> None:
    run = await _run(store, "token", "issue", "--node", "gpu-1")
    assert run.code == 0
    assert run.err == ""
    secrets = TOKEN.findall(run.out)
    assert len(secrets) == 1
    assert "will not be shown again" in run.out
    token = await store.find_node_token(hash_secret(secrets[0]))
    assert token is not None
    assert token.node_id == "gpu-1"
    assert token.token_id in run.out
    assert token.secret_hash not in run.out

    listing = await _run(store, "token", "list")
    as_json = await _run(store, "token", "list", "--json")
    for text in (listing.out, as_json.out):
        assert token.token_id in text
        assert "gpu-1" in text
        assert secrets[0] not in text
        assert token.secret_hash not in text
    assert json.loads(as_json.out) == [
        {
            "token_id": token.token_id,
            "node_id": "gpu-1",
            "created_at": token.created_at.isoformat(),
            "revoked_at": None,
            "expires_at": None,  # issued without --expires-in: never
            "previous_secret_until": None,
        }
    ]
    assert "INSERT INTO" in logs.text()  # the capture works: aiosqlite or the server logged it
    assert secrets[0] not in logs.text()


async def test_key_issue_prints_the_secret_once_with_its_policy(
    store: OpenedCredentialStore, logs: Logs
) -> None:
    run = await _run(
        store,
        "key",
        "issue",
        "--name",
        "team-a",
        "--models",
        "llama3, qwen",
        "--max-concurrent",
        "4",
    )
    assert run.code == 0
    secrets = KEY.findall(run.out)
    assert len(secrets) == 1
    assert "will not be shown again" in run.out
    key = await store.find_api_key(hash_secret(secrets[0]))
    assert key is not None
    assert key.key_id in run.out
    assert (key.name, key.models, key.max_concurrent) == ("team-a", ("llama3", "qwen"), 4)

    listing = await _run(store, "key", "list")
    assert key.key_id in listing.out
    assert "team-a" in listing.out
    assert "llama3,qwen" in listing.out
    assert secrets[0] not in listing.out
    assert key.secret_hash not in listing.out
    [entry] = json.loads((await _run(store, "key", "list", "--json")).out)
    assert entry["models"] == ["llama3", "qwen"]
    assert entry["max_concurrent"] == 4
    assert secrets[0] not in json.dumps(entry)
    assert key.secret_hash not in json.dumps(entry)
    assert "INSERT INTO" in logs.text()  # the capture works: aiosqlite or the server logged it
    assert secrets[0] not in logs.text()


async def test_an_operator_key_is_issued_and_listed_as_one(
    store: OpenedCredentialStore,
) -> None:
    issued = await _run(store, "key", "issue", "--name", "console", "--operator")
    assert issued.code == 0
    assert "operator" in issued.out
    assert (await _run(store, "key", "issue", "--name", "app")).code == 0
    operator, plain = await store.list_api_keys()
    assert (operator.name, operator.operator, plain.operator) == ("console", True, False)
    header, *rows = (await _run(store, "key", "list")).out.splitlines()
    assert "OPERATOR" in header.split()
    column = header.split().index("OPERATOR")
    assert {row.split()[1]: row.split()[column] for row in rows} == {"console": "yes", "app": "no"}
    listed = json.loads((await _run(store, "key", "list", "--json")).out)
    assert {entry["name"]: entry["operator"] for entry in listed} == {"console": True, "app": False}


async def test_key_without_policy_allows_every_model_without_limit(
    store: OpenedCredentialStore,
) -> None:
    assert (await _run(store, "key", "issue", "--name", "ops")).code == 0
    [key] = await store.list_api_keys()
    assert (key.models, key.max_concurrent) == ((), 0)
    listing = (await _run(store, "key", "list")).out
    assert "(all)" in listing
    assert "unlimited" in listing


async def test_revoke_marks_the_listing_and_a_repeat_is_harmless(
    store: OpenedCredentialStore,
) -> None:
    await _run(store, "token", "issue", "--node", "gpu-1")
    [token] = await store.list_node_tokens()
    revoked = await _run(store, "token", "revoke", token.token_id)
    assert revoked.code == 0
    assert f"Revoked node token {token.token_id}" in revoked.out
    [entry] = json.loads((await _run(store, "token", "list", "--json")).out)
    assert entry["revoked_at"] is not None
    again = await _run(store, "token", "revoke", token.token_id)
    assert again.code == 0
    assert "already revoked" in again.out

    await _run(store, "key", "issue", "--name", "team-a")
    [key] = await store.list_api_keys()
    assert (await _run(store, "key", "revoke", key.key_id)).code == 0
    [found] = await store.list_api_keys()
    assert found.revoked


@pytest.mark.parametrize(
    ("argv", "unknown"),
    [
        (("token", "revoke", "tok_00000000"), "tok_00000000"),
        (("key", "revoke", "key_00000000"), "key_00000000"),
    ],
)
async def test_revoking_an_unknown_id_fails_on_stderr(
    store: OpenedCredentialStore, argv: tuple[str, ...], unknown: str
) -> None:
    run = await _run(store, *argv)
    assert run.code == 1
    assert run.out == ""
    assert unknown in run.err


async def test_an_empty_node_id_fails_without_storing_anything(
    store: OpenedCredentialStore,
) -> None:
    run = await _run(store, "token", "issue", "--node", " ")
    assert run.code == 1
    assert "node id" in run.err
    assert TOKEN.search(run.out + run.err) is None
    assert await store.list_node_tokens() == []


async def test_empty_listings_say_so(store: OpenedCredentialStore) -> None:
    assert "No node tokens" in (await _run(store, "token", "list")).out
    assert "No API keys" in (await _run(store, "key", "list")).out
    assert json.loads((await _run(store, "key", "list", "--json")).out) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("key", "issue", "--name", "a", "--models", "llama3,,qwen"), "empty model name"),
        (("key", "issue", "--name", "a", "--models", ""), "leave --models out"),
        (("key", "issue", "--name", "a", "--max-concurrent", "-1"), "0 (unlimited) or more"),
        (("key", "issue", "--name", "a", "--max-concurrent", "two"), "not a whole number"),
        (("token", "issue"), "--node"),
        (("token",), "ACTION"),
    ],
)
def test_bad_arguments_are_refused_by_the_parser(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


async def test_run_command_refuses_args_without_a_credential_command(
    store: OpenedCredentialStore,
) -> None:
    with pytest.raises(ValueError, match="credential command"):
        await run_command(argparse.Namespace(command="serve"), store, io.StringIO())


async def test_token_issue_to_a_file_prints_only_where_it_went(
    store: OpenedCredentialStore, tmp_path: Path, logs: Logs
) -> None:
    path = tmp_path / "gpu-1.token"
    run = await _run(store, "token", "issue", "--node", "gpu-1", "--output", str(path))
    assert run.code == 0, run.err
    assert not TOKEN.search(run.out)
    assert str(path) in run.out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [secret] = TOKEN.findall(path.read_text())
    assert path.read_text() == f"{secret}\n"  # what a node's token_file holds
    token = await store.find_node_token(hash_secret(secret))
    assert token is not None
    assert token.node_id == "gpu-1"
    assert secret not in logs.text()

    # An existing file is not overwritten (a running node may use it) and no token is stored.
    again = await _run(store, "token", "issue", "--node", "gpu-1", "--output", str(path))
    assert again.code == 1
    assert "--force" in again.err
    assert path.read_text() == f"{secret}\n"
    assert len(await store.list_node_tokens()) == 1
    forced = await _run(
        store, "token", "issue", "--node", "gpu-1", "--output", str(path), "--force", "--json"
    )
    assert forced.code == 0, forced.err
    shown = json.loads(forced.out)
    assert shown["output"] == str(path)
    assert "token" not in shown
    assert TOKEN.findall(path.read_text()) != [secret]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_token_issue_to_a_missing_directory_stores_nothing(
    store: OpenedCredentialStore, tmp_path: Path
) -> None:
    run = await _run(store, "token", "issue", "--node", "n", "--output", str(tmp_path / "no/t"))
    assert run.code == 1
    assert "cannot write the token" in run.err
    assert await store.list_node_tokens() == []


async def test_every_credential_command_speaks_json(store: OpenedCredentialStore) -> None:
    issued = json.loads((await _run(store, "token", "issue", "--node", "n1", "--json")).out)
    assert TOKEN.fullmatch(issued["token"])
    assert issued["node_id"] == "n1"
    revoked = json.loads((await _run(store, "token", "revoke", issued["token_id"], "--json")).out)
    assert revoked["revoked_at"] is not None
    assert revoked["already_revoked"] is False
    again = json.loads((await _run(store, "token", "revoke", issued["token_id"], "--json")).out)
    assert again["already_revoked"] is True
    key = json.loads((await _run(store, "key", "issue", "--name", "k", "--json")).out)
    assert KEY.fullmatch(key["key"])
    assert key["models"] == []
    gone = json.loads((await _run(store, "key", "revoke", key["key_id"], "--json")).out)
    assert gone["revoked_at"] is not None


async def test_a_keys_limits_are_issued_updated_per_model_and_listed(
    store: OpenedCredentialStore,
) -> None:
    issue = await _run(
        store, "key", "issue", "--name", "agent", "--rpm", "60", "--output-tpm", "2000",
        "--budget", "100000", "--budget-period", "day", "--weight", "2", "--priority", "1",
    )  # fmt: skip
    assert issue.code == 0, issue.err
    assert "rpm=60 otpm=2000 budget=100000/day" in issue.out
    [key] = await store.list_api_keys()
    assert (key.limits.requests_per_minute, key.limits.token_budget) == (60, 100_000)
    assert (key.weight, key.priority) == (2, 1)

    for argv in (
        ("--rpm", "0", "--input-tpm", "500"),  # 0 removes the rpm; the rest stays
        ("--model", "qwen", "--rpm", "5", "--max-concurrent", "1"),
        ("--model", "llama", "--output-tpm", "100"),
        ("--model", "llama", "--clear"),
        ("--priority", "-2"),
    ):
        run = await _run(store, "key", "update", key.key_id, *argv)
        assert run.code == 0, (argv, run.err)
    [entry] = json.loads((await _run(store, "key", "list", "--json")).out)
    assert entry["limits"] == {
        "input_tokens_per_minute": 500,
        "output_tokens_per_minute": 2000,
        "token_budget": 100_000,
        "budget_period": "day",
    }
    assert entry["model_limits"] == {"qwen": {"requests_per_minute": 5, "max_concurrent": 1}}
    assert (entry["weight"], entry["priority"], entry["max_concurrent"]) == (2, -2, 0)
    listing = (await _run(store, "key", "list")).out
    assert "itpm=500 otpm=2000 budget=100000/day; qwen: rpm=5 concurrent=1" in listing

    unknown = await _run(store, "key", "update", "key_00000000", "--rpm", "1")
    assert (unknown.code, "no API key" in unknown.err) == (1, True)
    await _run(store, "key", "revoke", key.key_id)
    revoked = await _run(store, "key", "update", key.key_id, "--rpm", "1")
    assert (revoked.code, "revoked" in revoked.err) == (1, True)


async def test_expiry_and_rotation_on_the_command_line(
    store: OpenedCredentialStore, logs: Logs, tmp_path: Path
) -> None:
    issued = await _run(store, "token", "issue", "--node", "gpu-1", "--expires-in", "30d")
    assert issued.code == 0, issued.err
    [old] = TOKEN.findall(issued.out)
    [token] = await store.list_node_tokens()
    assert token.expires_at is not None
    assert 29.9 < (token.expires_at - token.created_at).total_seconds() / 86400 <= 30
    listing = await _run(store, "token", "list")
    assert "EXPIRES" in listing.out
    assert token.expires_at.strftime("%Y-%m-%d") in listing.out

    output = tmp_path / "gpu-1.token"
    rotated = await _run(store, "token", "rotate", token.token_id, "--overlap", "1h",
                         "--output", str(output), "--json")  # fmt: skip
    assert rotated.code == 0, rotated.err
    new = output.read_text().strip()
    assert TOKEN.fullmatch(new)
    assert new not in rotated.out  # only where it went
    shown = json.loads(rotated.out)
    assert shown["id"] == token.token_id
    assert shown["previous_secret_until"] is not None
    assert await store.find_node_token(hash_secret(new)) == await store.find_node_token(
        hash_secret(old)
    )
    assert old not in logs.text()
    assert new not in logs.text()

    key = await _run(store, "key", "issue", "--name", "ci", "--expires-at", "2099-01-31T00:00Z")
    assert key.code == 0, key.err
    [stored] = await store.list_api_keys()
    assert stored.expires_at is not None
    assert stored.expires_at.isoformat() == "2099-01-31T00:00:00+00:00"
    again = await _run(store, "key", "rotate", stored.key_id)
    assert again.code == 0, again.err
    [fresh] = KEY.findall(again.out)
    assert fresh not in key.out
    past = await _run(store, "key", "issue", "--name", "late", "--expires-at", "2001-01-01T00:00Z")
    assert past.code == 1
    assert "not in the future" in past.err
    with pytest.raises(SystemExit):
        _parser().parse_args(["key", "issue", "--name", "x", "--expires-in", "soon"])
    gone = await _run(store, "key", "rotate", "key_00000000")
    assert gone.code == 1
    assert "no API key" in gone.err
