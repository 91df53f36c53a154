"""No secret in any log: every malformed request the fault suite sends, sent with a real API
key, leaves no trace of the key in any service's log.

aiohttp's parse errors (``BadHttpMessage`` and kin) carry the raw bytes around the
error, Authorization header included; logged with their traceback, as aiohttp does by
default, they copied the client's key into the edge's log, ten lines per request. Here
every shape goes to every HTTP port of the stack (the edge's API, each service's admin
port) with a key the control-plane issued; the stack is then stopped, so every line it
wrote is in, and each service's whole log (control-plane, edge, both nodes, worker) is
searched for any 12 characters of the key's secret part, and of each node's token.

The shapes: the fault suite's (``tests/faults/test_http_bad_input.py``'s bad bodies and
routing errors, a body over the limit, ``test_slow_clients``'s trickled body,
``test_identity``'s plaintext on the TLS port) and the request-line and header shapes a
parser refuses (bare LF line endings, an obs-folded or NUL-carrying ``Authorization``,
over-long headers, a bad method or version, conflicting lengths, a broken chunk). Each
parse error is one short line at most: no traceback in any log.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from iop_edge.service.limits import DEFAULT_MAX_BODY_BYTES
from iop_edge.testing import BAD_BODIES

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

KEY_MARK = b"@KEY@"
WINDOW = 12  # any this many characters of a secret, anywhere in a log, is a leak
READ_TIMEOUT_S = 2  # the edge's http.read_timeout_s here: the trickled body is cut fast

# The fault suite's bad bodies (iop_edge.testing.BAD_BODIES), each sent with the key, to every
# inference route.
ROUTES = ("chat/completions", "completions", "embeddings", "batches", "responses")

# Raw requests a parser refuses, ``@KEY@`` standing for the key. Each is sent on a
# connection of its own, to every HTTP port.
RAW_SHAPES: dict[str, bytes] = {
    "bare LF line endings": (
        b"GET /v1/models HTTP/1.1\nHost: edge\nAuthorization: Bearer @KEY@\n\n"
    ),
    "bare LF after the request line": (
        b"GET /v1/models HTTP/1.1\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n\r\n"
    ),
    "obs-folded Authorization": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer\r\n @KEY@\r\n\r\n"
    ),
    "obs-folded after the key": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n\tx\r\n\r\n"
    ),
    "NUL in Authorization": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\x00\r\n\r\n"
    ),
    "bare CR in Authorization": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\rx\r\n\r\n"
    ),
    "space before the colon": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization : Bearer @KEY@\r\n\r\n"
    ),
    "bad header name": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuth(orization): Bearer @KEY@\r\n\r\n"
    ),
    "header over 8 KiB": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@"
        + b"A" * 9000
        + b"\r\n\r\n"
    ),
    "key in an over-long URL": b"GET /v1/models?k=@KEY@" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    "space in the URL": b"GET /v1/models?api_key=@KEY@ x HTTP/1.1\r\nHost: edge\r\n\r\n",
    "bad method": b"G(T /v1/models HTTP/1.1\r\nAuthorization: Bearer @KEY@\r\n\r\n",
    "bad version": b"GET /v1/models HTTP/9.Z\r\nAuthorization: Bearer @KEY@\r\n\r\n",
    "Content-Length and Transfer-Encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "Content-Length not a number": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n"
        b"Content-Length: @KEY@\r\n\r\n"
    ),
    "broken chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz@KEY@\r\n{}\r\n0\r\n\r\n"
    ),
    "a second request that is not HTTP": (
        b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n@KEY@ @KEY@\r\n\r\n"
    ),
    "not HTTP at all": b"Bearer @KEY@\r\n\r\n",
}

# A malformed byte in a header that parses: the request is answered, by authentication.
BAD_KEY_BYTES: dict[str, bytes] = {
    "invalid UTF-8 in Authorization": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\xff\r\n\r\n"
    ),
    "invalid UTF-8 in x-api-key": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nx-api-key: \xc3(@KEY@\r\n\r\n"
    ),
    "Latin-1 in Authorization": (
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer \xe9@KEY@\r\n\r\n"
    ),
}


async def raw_exchange(port: int, request: bytes, timeout_s: float = 15) -> bytes:
    """Send ``request`` on a new connection; everything read until the server closes it
    (or ``timeout_s``, for a server that keeps a connection open after its answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = b""
    try:
        writer.write(request)
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while chunk := await reader.read(65536):
                    answer += chunk
    except ConnectionError:
        pass  # cut while the request was being written: an answer of its own
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return answer


def statuses(answer: bytes) -> list[int]:
    """The status of every response in ``answer`` (pipelined ones too)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def leaks(secret: str, lines: list[str]) -> list[str]:
    """The lines holding any ``WINDOW`` characters of ``secret`` in a row."""
    windows = {secret[i : i + WINDOW] for i in range(len(secret) - WINDOW + 1)}
    return [line for line in lines if any(window in line for window in windows)]


def report(text: str) -> None:
    print(f"\n[no secret in logs] {text}")  # with -s: the counts as the test runs


def api_port(stack: Any) -> int:
    return int(stack.api_url.rsplit(":", 1)[1].split("/", 1)[0])


def admin_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 2,
        "max_queue": 4,
        "tokens_per_second": 500,
    }


FLEET: dict[str, object] = {
    "models": [
        {"id": "mock-small", "providers": {"node-a-mock": "small-a", "node-b-mock": "small-b"}}
    ],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "small-a")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "small-b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}


async def send_everything(stack: Any, key: str) -> list[str]:
    """Every shape, with ``key``, to every HTTP port; returns each answer that is not the
    one expected, so a shape that silently stopped reaching the parser (a 200, say) fails
    the test instead of passing the log search for nothing."""
    seen: Counter[str] = Counter()
    wrong: list[str] = []

    def expect(ok: bool, *what: object) -> None:
        if not ok:
            wrong.append(repr(what)[:400])

    ports = {"edge api": api_port(stack)}
    ports |= {f"{name} admin": admin_port(s.admin_url) for name, s in stack.services.items()}
    for port_name, port in ports.items():
        for name, shape in RAW_SHAPES.items():
            answer = await raw_exchange(port, shape.replace(KEY_MARK, key.encode()))
            got = statuses(answer)
            seen[f"{port_name} {got}"] += 1
            # refused by the parser: a 400 (431 for a field too long), never a 5xx, or the
            # connection closed (a server may just hang up on bytes that are not HTTP)
            ok = all(s < 500 for s in got) and got[-1:] in ([], [400], [431])
            expect(ok, port_name, name, answer[:300])
        for name, shape in BAD_KEY_BYTES.items():
            request = shape.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
            answer = await raw_exchange(port, request.replace(KEY_MARK, key.encode()))
            got = statuses(answer)
            seen[f"{port_name} {got}"] += 1
            expected = [401] if port_name == "edge api" else [404]  # admin ports: no /v1 route
            expect(got == expected, port_name, name, answer[:300])
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        for route in ROUTES:
            for name, (content_type, body) in BAD_BODIES.items():
                async with http.post(
                    f"{stack.api_url}/{route}",
                    data=body,
                    headers={**headers, "Content-Type": content_type},
                ) as response:
                    seen[f"edge api bad body {response.status}"] += 1
                    expect(response.status == 400, route, name, await response.read())
        for method, path, status in (
            ("GET", "/v1/chat/completions", 405),
            ("POST", "/v1/nowhere", 404),
            ("DELETE", "/v1/models", 405),
        ):
            origin = stack.api_url.removesuffix("/v1")
            async with http.request(method, origin + path, headers=headers) as response:
                expect(response.status == status, method, path, response.status)
        head = b'{"model": "mock-small", "messages": [{"role": "user", "content": "'
        tail = b'"}]}'
        body = head + b"a" * (DEFAULT_MAX_BODY_BYTES + 1 - len(head) - len(tail)) + tail
        async with http.post(
            f"{stack.api_url}/chat/completions",
            data=io.BytesIO(body),
            headers={**headers, "Content-Type": "application/json"},
        ) as response:
            expect(response.status == 413, "over the limit", response.status)
        # the one well-formed request: the key works, so a leak would be a real one
        chat = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(
            f"{stack.api_url}/chat/completions", json={**chat, "max_tokens": 4}, headers=headers
        ) as response:
            expect(response.status == 200, "well-formed", await response.read())
    # test_slow_clients' trickled body, cut after http.read_timeout_s
    trickle = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer @KEY@\r\n"
        b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{"
    )
    answer = await raw_exchange(
        api_port(stack), trickle.replace(KEY_MARK, key.encode()), timeout_s=READ_TIMEOUT_S * 10
    )
    seen[f"edge api trickled body {statuses(answer)}"] += 1
    # test_identity's plaintext on a TLS port, with the key, to both IOP listeners
    plaintext = b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer @KEY@\r\n\r\n"
    for port in (stack.node_port, stack.cp_port):
        answer = await raw_exchange(port, plaintext.replace(KEY_MARK, key.encode()))
        expect(not answer.startswith(b"HTTP/"), "plaintext on TLS", answer[:100])
    report(f"answers: {dict(sorted(seen.items()))}")
    return wrong


async def test_no_key_or_token_reaches_any_log(tmp_path: Path, start_stack_factory: Any) -> None:
    http = {"host": "127.0.0.1", "port": 0, "read_timeout_s": READ_TIMEOUT_S}
    async with start_stack_factory(tmp_path, FLEET, {"http": http}) as stack:
        key = await stack.issue_key("leaky", within_s=15)
        wrong = await send_everything(stack, key)
        services = dict(stack.services)
        tokens = {
            node: yaml.safe_load((tmp_path / f"{node}.yaml").read_text())["token"]
            for node in ("node-a", "node-b")
        }
    # stopped: every line each service wrote is in its log now
    secrets = {"the API key": key.removeprefix("sk-iop-")}
    secrets |= {f"{node}'s token": t.removeprefix("iopnt_") for node, t in tokens.items()}
    found: dict[str, int] = {}
    tracebacks: dict[str, int] = {}
    for name, service in services.items():
        for what, secret in secrets.items():
            lines = leaks(secret, service.log)
            if lines:
                found[f"{what} in {name}'s log"] = len(lines)
                report(f"{what} in {name}'s log, e.g. {lines[0][:300]!r}")
        tracebacks[name] = sum("Traceback (most recent call last)" in line for line in service.log)
    report(f"lines with a secret: {found or 'none'}; tracebacks per log: {tracebacks}")
    report(f"{len(wrong)} unexpected answers: {wrong}")
    assert not found
    assert not any(tracebacks.values()), tracebacks
    assert not wrong
