"""A backup taken from a running stack, restored into a fresh one (new root, new CA), serves
what it held: the key issued before works, a file reads back, a finished batch's output,
a stored response continues, and the node's run history is back.

Every command is the services' own console script (``backup PATH``, ``restore PATH``),
run against live processes: the backups are taken while the stack serves.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from openai import AsyncOpenAI

Stack = Any


def _mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 4,
        "tokens_per_second": 500,
    }


FLEET: dict[str, object] = {  # node-a serves every run, so its history holds them all
    "models": [{"id": "mock-small", "providers": {"a": "mock-small"}}],
    "nodes": [
        {"id": "node-a", "providers": [_mock("a", "mock-small")]},
        {"id": "node-b", "providers": []},
    ],
}
BATCH_LINES = [
    {
        "custom_id": f"line-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "mock-small", "messages": [{"role": "user", "content": f"q{i}"}]},
    }
    for i in range(3)
]
BATCH_INPUT = "".join(json.dumps(line) + "\n" for line in BATCH_LINES).encode()


async def _cli(script: str, config: Path, *args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / script),
        "--config",
        str(config),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode()


async def _ok(script: str, config: Path, *args: str) -> str:
    code, out = await _cli(script, config, *args)
    assert code == 0, out
    return out


def _rows(database: Path, table: str) -> int:
    db = sqlite3.connect(database)
    try:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    finally:
        db.close()


async def _served_and_guarded(api_url: str, secret: str) -> None:
    """Until the edge serves ``secret`` and refuses a key nobody issued: it holds the
    restored keys (an edge with no key at all would serve any)."""
    ours = {"Authorization": f"Bearer {secret}"}
    bogus = {"Authorization": "Bearer sk-iop-not-a-key"}
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        while True:
            async with http.get(f"{api_url}/models", headers=ours) as mine:
                async with http.get(f"{api_url}/models", headers=bogus) as theirs:
                    if mine.status == 200 and theirs.status == 401:
                        return
            await asyncio.sleep(0.1)


async def _finished_batch(sdk: AsyncOpenAI, batch_id: str) -> Any:
    async with asyncio.timeout(90):
        while (batch := await sdk.batches.retrieve(batch_id)).status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing"), batch
            await asyncio.sleep(0.2)
    return batch


async def test_a_backup_restored_into_a_fresh_stack_serves_what_it_held(
    start_stack_factory: Any, tmp_path: Path
) -> None:
    backups = tmp_path / "backups"
    async with start_stack_factory(tmp_path / "before", FLEET) as old:
        secret = await old.issue_key("kept")
        async with AsyncOpenAI(base_url=old.api_url, api_key=secret, max_retries=0) as sdk:
            upload = await sdk.files.create(file=("in.jsonl", BATCH_INPUT), purpose="batch")
            created = await sdk.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch = await _finished_batch(sdk, created.id)
            output = (await sdk.files.content(batch.output_file_id or "")).text
            stored = await sdk.responses.create(
                model="mock-small", input="remember alpha", store=True
            )
        node_token = yaml.safe_load((old.root / "node-a.yaml").read_text())["token"]
        history = _rows(old.root / "node-a-history.db", "runs")
        # Taken while every service runs (SQLite's online backup: the WAL's commits too).
        await asyncio.gather(
            _ok("iop-control-plane", old.cp_settings, "backup", str(backups / "control-plane")),
            _ok("iop-edge", old.root / "edge.yaml", "backup", str(backups / "edge")),
            _ok("iop-node", old.root / "node-a.yaml", "backup", str(backups / "node-a")),
        )
    assert history > 0

    async with start_stack_factory(tmp_path / "after", FLEET) as fresh:
        edge_yaml = fresh.root / "edge.yaml"
        live, other, again = await asyncio.gather(
            _cli("iop-edge", edge_yaml, "restore", str(backups / "edge")),
            _cli("iop-edge", edge_yaml, "restore", str(backups / "control-plane")),
            _cli("iop-edge", edge_yaml, "backup", str(backups / "edge")),
        )
        assert live[0] == 1  # the edge runs: its files are live
        assert "stop the edge first and pass --force" in live[1]
        assert other[0] == 1
        assert "a backup of the control-plane, not of the edge" in other[1]
        assert again[0] == 1  # a backup is never written over
        assert "not an empty directory" in again[1]
        # The worker and node-b are not needed to serve what was kept: they stay stopped.
        await asyncio.gather(*(fresh.stop(name) for name in ("worker", "node-a", "node-b")))
        await fresh.stop("edge")
        await fresh.stop("control-plane")
        await asyncio.gather(
            _ok(
                "iop-control-plane",
                fresh.cp_settings,
                "restore",
                str(backups / "control-plane"),
                "--force",
            ),
            _ok("iop-edge", edge_yaml, "restore", str(backups / "edge"), "--force"),
            _ok(
                "iop-node",
                fresh.root / "node-a.yaml",
                "restore",
                str(backups / "node-a"),
                "--force",
            ),
        )
        assert _rows(fresh.root / "node-a-history.db", "runs") >= history
        # node-a's token is the restored store's (a node keeps its token file).
        settings = fresh.root / "node-a.yaml"
        data = yaml.safe_load(settings.read_text())
        settings.write_text(yaml.safe_dump({**data, "token": node_token}))
        await fresh.start("control-plane")
        await fresh.start("edge")
        await fresh.start("node-a")
        await fresh.wait_registered(("node-a",))

        await _served_and_guarded(fresh.api_url, secret)
        async with AsyncOpenAI(base_url=fresh.api_url, api_key=secret, max_retries=0) as sdk:
            assert (await sdk.files.content(upload.id)).content == BATCH_INPUT
            kept = await sdk.batches.retrieve(created.id)
            assert kept.status == "completed"
            assert kept.output_file_id == batch.output_file_id
            assert (await sdk.files.content(batch.output_file_id or "")).text == output
            assert (await sdk.responses.retrieve(stored.id)).id == stored.id
            follow = await sdk.responses.create(
                model="mock-small", input="and beta", previous_response_id=stored.id
            )
            assert follow.status == "completed"
            assert follow.previous_response_id == stored.id


pytestmark = pytest.mark.asyncio(loop_scope="function")
