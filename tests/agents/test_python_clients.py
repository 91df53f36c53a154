"""Python client libraries, as their users write them, against ``make run``'s stack:
LlamaIndex (``OpenAILike``: chat, stream, concurrent async completions), litellm
(``completion``, streamed and not, with ``max_tokens`` 32,000 as agents ask), instructor
(a pydantic model with constraints through a tool call) and pydantic-ai (a text answer and
a structured one over chat completions, Responses and Messages).

Each runs in its own ``var/clients/<check>`` venv (``make agents``), where the library's
own pins of ``openai`` and ``anthropic`` hold, as ``clients.py CHECK``. The mock answers,
so the structured answers hold the mock's schema-satisfying tool arguments, validated
again by the library itself.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
CLIENTS = HERE.parents[1] / "var" / "clients"  # a venv per library, named as the check
REQUIRED = os.environ.get("TEST_AGENTS_REQUIRED") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]


async def _check(origin: str, check: str, model: str = "mock-small") -> dict[str, Any]:
    python = CLIENTS / check / "bin" / "python"
    if not python.exists():
        if REQUIRED:
            pytest.fail(f"{python} is missing (make agents installs the client libraries)")
        pytest.skip(f"{check} is not installed (make agents)")
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(HERE / "clients.py"),
        origin,
        model,
        check,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(HERE), "NO_PROXY": "127.0.0.1"},
    )
    out, err = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, err.decode()[-4000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def _city(city: dict[str, Any]) -> None:
    assert city["name"]
    assert city["population"] > 0
    assert city["area_km2"] >= 0
    assert city["kind"] in {"city", "town"}


async def test_litellm(origin: str) -> None:
    got = await _check(origin, "litellm")
    assert got["text"]
    assert got["finish_reason"] == "stop"
    assert got["streamed"]


async def test_instructor(origin: str) -> None:
    _city((await _check(origin, "instructor"))["city"])


async def test_pydantic_ai(origin: str) -> None:
    got = await _check(origin, "pydantic-ai")
    assert set(got) == {"chat", "responses", "messages"}
    for api in got.values():
        assert api["text"]
        _city(api["city"])


async def test_llamaindex(origin: str) -> None:
    got = await _check(origin, "llamaindex")
    assert got["text"]
    assert got["streamed"]
    assert len(got["async"]) == 3
    assert all(got["async"])
