"""What the multihost tests ask of the hosts: the API from inside a host's namespace, the
control-plane's CLI on host 1, and the figures file the suite writes.

Addresses exist only between the namespaces, so every request is made by a small
process started in the host it is made from.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from guide import ROOT, Guide
from netns import Host

POLL_S = 0.25
FIGURES = ROOT / "var" / "multihost" / "figures.json"

_FETCH = """
import json, sys, urllib.error, urllib.request
method, url, body, key = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
headers = {"Content-Type": "application/json"}
if key:
    headers["Authorization"] = f"Bearer {key}"
request = urllib.request.Request(url, data=body.encode() or None, method=method, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=60) as answer:
        print(json.dumps([answer.status, json.loads(answer.read() or b"null")]))
except urllib.error.HTTPError as error:
    print(json.dumps([error.code, json.loads(error.read() or b"null")]))
except OSError as error:  # no answer at all: status 0, and why
    print(json.dumps([0, repr(error)]))
"""


async def http(
    host: Host, method: str, path: str, body: object = None, *, to: str = "127.0.0.1", key: str = ""
) -> tuple[int, Any]:
    """A request from inside ``host`` to the API at ``to``:8080 (by default the edge on the
    host itself), with the API key ``key`` if given."""
    process = await asyncio.create_subprocess_exec(
        *host.wrapper,
        sys.executable,
        "-c",
        _FETCH,
        method,
        f"http://{to}:8080{path}",
        "" if body is None else json.dumps(body),
        key,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    status, answer = json.loads(out)
    return int(status), answer


async def catalog(host: Host, kind: str, key: str = "") -> dict[str, dict[str, Any]]:
    status, answer = await http(host, "GET", f"/iop/v1/catalog/{kind}", key=key)
    assert status == 200, answer
    key = "provider_id" if kind == "providers" else "id"
    return {entry[key]: entry for entry in answer["data"]}


async def eventually(
    check: Callable[[], Awaitable[bool]], within_s: float, seen: object = None
) -> float:
    """Poll ``check`` until true; the seconds it took. Fails after ``within_s``, showing
    ``seen`` (what the check last saw, where it keeps that)."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within_s, f"not so within {within_s} s: {seen}"
        await asyncio.sleep(POLL_S)
    return time.monotonic() - started


def available(
    host: Host, model: str, provider: str, key: str = ""
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        entry = (await catalog(host, "models", key)).get(model)
        return entry is not None and provider in entry["available_providers"]

    return check


async def chat(host: Host, model: str, *, to: str = "127.0.0.1", key: str = "") -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return await http(host, "POST", "/v1/chat/completions", body, to=to, key=key)


def control_plane_cli(guide: Guide, *args: str) -> str:
    """The control-plane's CLI on host 1, with the settings file the guide wrote there."""
    settings = guide.files(1).root / "etc/iop/control-plane.yaml"
    return " ".join([f"{sys.prefix}/bin/iop-control-plane", "--config", str(settings), *args])


def node_list(guide: Guide) -> str:
    return control_plane_cli(guide, "node", "list", "--json")


def record(figures: dict[str, Any]) -> None:
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    FIGURES.write_text(json.dumps({**known, **figures}, indent=2) + "\n")
    print(f"\n[multihost] {figures}")
