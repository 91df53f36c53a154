"""Requests under load, run inside a test host: one JSON line per request as it ends.

    python load_client.py URL KEY MODEL TOTAL CONCURRENCY

``TOTAL`` chat completions to ``URL`` (``http://HOST4:8080/v1``, the balancer),
``CONCURRENCY`` at a time, one connection each (as a client whose kept-alive connection
died opens a new one). Each line: ``started`` and ``ended`` (``time.monotonic()``, the
machine's clock, which every namespace shares with the test), and ``kind``:

- ``completed``: a 200 with a choice;
- ``error``: an OpenAI error object (a clear error the client can act on);
- ``cut``: the connection ended under it (every HTTP client reports that: a clear error);
- ``lost``: no answer within the deadline, or one that is none of the above.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

DEADLINE_S = 60.0  # far beyond a request's time here: only a real hang reaches it


async def one(http: aiohttp.ClientSession, url: str, key: str, model: str) -> tuple[str, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with asyncio.timeout(DEADLINE_S):
            async with http.post(f"{url}/chat/completions", json=body, headers=headers) as reply:
                answer: Any = await reply.json()
    except TimeoutError:
        return "lost", "no answer within the deadline"
    except aiohttp.ContentTypeError as exc:
        return "lost", f"{exc.status}: not json"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        return "cut", type(exc).__name__
    if reply.status == 200 and answer.get("choices"):
        return "completed", ""
    error = answer.get("error") if isinstance(answer, dict) else None
    if reply.status >= 400 and isinstance(error, dict) and error.get("message"):
        return "error", f"{reply.status}: {error.get('code') or error.get('type')}"
    return "lost", f"{reply.status}: {str(answer)[:200]}"


async def main(url: str, key: str, model: str, total: int, concurrency: int) -> None:
    numbers = iter(range(total))
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> None:
            for number in numbers:
                started = time.monotonic()
                kind, detail = await one(http, url, key, model)
                line = {"n": number, "started": started, "ended": time.monotonic()}
                print(json.dumps({**line, "kind": kind, "detail": detail}), flush=True)

        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client())


if __name__ == "__main__":
    url, key, model, total, concurrency = sys.argv[1:6]
    asyncio.run(main(url, key, model, int(total), int(concurrency)))
