"""A fleet mid-upgrade (docs/upgrading.md): the previous release's node behind this edge,
and this release's node behind the previous release's edge; a completion works both
ways. The previous release runs from its own sources (``git archive`` of
``PREVIOUS_RELEASE`` on PYTHONPATH, this venv's packages), so its code is what ran then.

Also the one-way door: the previous edge refuses the run log this release migrated
(schema 5; it reads 4), which is why a rollback restores the backup taken before.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

Stack = Any

PREVIOUS_RELEASE = "dfa5a91"
"""The release before per-key limits and fair queues (issue 32), the last upgrade's base."""
REPO = Path(__file__).resolve().parents[2]

FLEET: dict[str, object] = {
    "models": [{"id": "on-a", "providers": {"a": "on-a"}}],
    "nodes": [
        {
            "id": "node-a",
            "providers": [
                {
                    "id": "a",
                    "type": "mock",
                    "category": "local_inference",
                    "models": ["on-a"],
                    "capacity": 2,
                }
            ],
        },
        {"id": "node-b", "providers": []},
    ],
}


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's services' sources, extracted from this repository's history."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs this repository's git history")
    found = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "proto/src", "services"],
        capture_output=True,
        check=False,
    )
    if found.returncode != 0:
        pytest.skip(f"{PREVIOUS_RELEASE} is not in this clone: {found.stderr.decode().strip()}")
    root = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=io.BytesIO(found.stdout)) as archive:
        archive.extractall(root, filter="data")
    # Its own code is what runs on that PYTHONPATH: its node has no `backup` command yet.
    script = str(Path(sys.executable).parent / "iop-node")
    env = {**os.environ, **_pythonpath(root, "node")}
    old = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, check=False)
    new = subprocess.run([script, "--help"], capture_output=True, text=True, check=False)
    assert "backup" not in old.stdout
    assert "backup" in new.stdout
    return root


def _pythonpath(root: Path, service: str) -> dict[str, str]:
    return {"PYTHONPATH": f"{root / 'services' / service / 'src'}:{root / 'proto' / 'src'}"}


async def _completion(api_url: str) -> str:
    body = {"model": "on-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{api_url}/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    return str(answer["choices"][0]["message"]["content"])


def _same_port_settings(stack: Stack, name: str, **changes: object) -> None:
    path = stack.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))


async def test_previous_node_behind_this_edge_and_this_node_behind_the_previous_edge(
    start_stack_factory: Any, tmp_path: Path, previous_release: Path
) -> None:
    async with start_stack_factory(tmp_path / "stack", FLEET, drills=False) as stack:
        assert await _completion(stack.api_url)

        # The previous release's node, behind this edge (its own history file: the same
        # schema, but a node's history is its own).
        await stack.stop("node-a")
        _same_port_settings(stack, "node-a", history_db=str(stack.root / "old-node.db"))
        await stack.start("node-a", env=_pythonpath(previous_release, "node"))
        await stack.wait_registered(("node-a",))
        assert await _completion(stack.api_url)

        # The previous edge on this release's run log: refused, nothing changed.
        await stack.stop("worker")
        await stack.stop("edge")
        with pytest.raises(RuntimeError, match="newer than this edge understands"):
            await stack.start("edge", env=_pythonpath(previous_release, "edge"))

        # This release's node behind the previous edge (and this control-plane).
        await stack.stop("node-a")
        _same_port_settings(stack, "node-a", history_db=str(stack.root / "node-a-history.db"))
        old_edge_files = {
            "history_db": str(stack.root / "old-runs.db"),
            "responses_db": str(stack.root / "old-responses.db"),
            "batch_db": str(stack.root / "old-batches.db"),
        }
        _same_port_settings(stack, "edge", **old_edge_files)
        await stack.start("edge", env=_pythonpath(previous_release, "edge"))
        await stack.start("node-a")
        await stack.wait_registered(("node-a", "node-b"))
        assert await _completion(stack.api_url)
