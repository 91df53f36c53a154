"""A large upload is streamed to storage: the edge's memory does not grow by the file's size.

The real edge process, a 100 MB batch file uploaded, downloaded and deleted
with the official OpenAI SDK, and the edge's resident memory read from
``/proc/<pid>/status`` around each step: ``VmRSS`` now, and ``VmHWM``, the
highest it has ever been (so a peak between two readings is seen too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MB = 1024 * 1024
UPLOAD_BYTES = 100 * MB
MAX_GROWTH = 40 * MB
"""Loose on purpose: the allocator keeps some freed memory, threads have stacks; a file
held whole (let alone twice, as joined chunks and as a BLOB parameter) is 100 MB or more."""


def memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in bytes."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0]) * 1024  # reported in kB
    return values


def big_jsonl(size: int) -> bytes:
    line = json.dumps(
        {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "mock-small", "messages": [{"role": "user", "content": "y" * 900}]},
        }
    ).encode()
    line += b"\n"
    return line * (size // len(line))


def mb(value: int) -> str:
    return f"{value / MB:.1f} MB"


async def test_a_100_mb_upload_and_delete_leave_the_edges_memory_where_it_was(
    stack: Stack, request: pytest.FixtureRequest
) -> None:
    pid = stack.services["edge"].process.pid
    content = big_jsonl(UPLOAD_BYTES)
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        # Warm up the paths (threads, imports, buffers) with a small file first.
        warm = await client.files.create(file=("warm.jsonl", content[: 4 * MB]), purpose="batch")
        assert (await client.files.content(warm.id)).content == content[: 4 * MB]
        await client.files.delete(warm.id)

        before = memory(pid)
        upload = await client.files.create(file=("big.jsonl", content), purpose="batch")
        uploaded = memory(pid)
        assert upload.bytes == len(content)
        await client.files.delete(upload.id)
        deleted = memory(pid)

        again = await client.files.create(file=("big.jsonl", content), purpose="batch")
        downloaded_bytes = (await client.files.content(again.id)).content
        assert downloaded_bytes == content
        del downloaded_bytes
        downloaded = memory(pid)
        await client.files.delete(again.id)
        end = memory(pid)

    print(
        f"\n[{request.node.name}] edge VmRSS: before {mb(before['VmRSS'])}, "
        f"after a {mb(len(content))} upload {mb(uploaded['VmRSS'])}, after deleting it "
        f"{mb(deleted['VmRSS'])} (growth {mb(deleted['VmRSS'] - before['VmRSS'])}); "
        f"uploaded again and downloaded {mb(downloaded['VmRSS'])}, deleted {mb(end['VmRSS'])}; "
        f"VmHWM (peak) {mb(before['VmHWM'])} -> {mb(uploaded['VmHWM'])} after the upload, "
        f"{mb(end['VmHWM'])} at the end"
    )
    assert deleted["VmRSS"] - before["VmRSS"] < MAX_GROWTH
    assert uploaded["VmHWM"] - before["VmHWM"] < MAX_GROWTH  # never held whole, even briefly
    assert end["VmRSS"] - before["VmRSS"] < MAX_GROWTH
    assert end["VmHWM"] - before["VmHWM"] < MAX_GROWTH  # the download is streamed too
