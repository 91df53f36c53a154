"""The requests the real coding agents sent, replayed: the contract ``make test`` holds
without any agent installed.

``tests/agents/requests/<agent>.json`` holds, per model, every request one agent (Codex
CLI over SSE and over WebSocket, Claude Code, opencode, Continue CLI, aider, at the
versions ``make agents`` pins) sent during a turn of ``make test-agents``, recorded by its
relay with ``AGENTS_RECORD=1`` (no secret is recorded). Each ``mock-small`` request is sent
again, body and headers as the agent sent them, to a real stack of mock providers, and
must succeed to its API's own end: a stream to ``response.completed`` / ``message_stop`` /
``[DONE]``, a JSON answer with its object, a WebSocket session to ``response.completed``
for each ``response.create``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

REQUESTS = Path(__file__).resolve().parents[1] / "agents" / "requests"
MOCK = "mock-small"
DROP = frozenset({"host", "content-length", "connection", "accept-encoding", "upgrade"})
pytestmark = pytest.mark.asyncio(loop_scope="module")


def _recorded() -> list[Any]:
    cases = []
    for path in sorted(REQUESTS.glob("*.json")):
        for index, request in enumerate(json.loads(path.read_text()).get(MOCK, [])):
            if request.get("body") is not None or request.get("socket_messages"):
                cases.append(pytest.param(request, id=f"{path.stem}-{index}"))
    return cases


CASES = _recorded()


def _headers(request: dict[str, Any]) -> dict[str, str]:
    """The agent's headers but the connection's own (a WebSocket handshake is this
    client's, its compression offer included)."""
    return {
        k: v
        for k, v in request["headers"].items()
        if k.lower() not in DROP and not k.lower().startswith("sec-websocket-")
    }


async def _replay_http(origin: str, request: dict[str, Any]) -> None:
    path = request["path"]
    async with aiohttp.ClientSession() as http:
        async with http.post(
            origin + path, json=request["body"], headers=_headers(request)
        ) as answer:
            text = await answer.text()
            assert answer.status == 200, text[:2000]
            streamed = answer.headers.get("Content-Type", "").startswith("text/event-stream")
    if not streamed:
        body = json.loads(text)
        expected = {"/v1/responses": "response", "/v1/messages": "message"}
        kind = next((v for k, v in expected.items() if path.startswith(k)), "chat.completion")
        assert body.get("object", body.get("type")) == kind, text[:2000]
        return
    if path.startswith("/v1/responses"):
        assert "event: response.completed" in text, text[-2000:]
    elif path.startswith("/v1/messages"):
        assert "event: message_stop" in text, text[-2000:]
    else:
        assert text.rstrip().endswith("data: [DONE]"), text[-2000:]


async def _replay_socket(origin: str, request: dict[str, Any]) -> None:
    url = origin.replace("http", "ws", 1) + request["path"]
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, headers=_headers(request)) as socket:
            last_id: str | None = None
            for message in request["socket_messages"]:
                if "previous_response_id" in message:
                    # Codex continues the socket's last response: this replay's, whose id
                    # is new (the recorded one existed only on the recorded connection).
                    message = {**message, "previous_response_id": last_id}
                await socket.send_str(json.dumps(message))
                while True:
                    event = json.loads(await socket.receive_str(timeout=30))
                    assert event["type"] not in {"error", "response.failed"}, event
                    if event["type"] in {"response.completed", "response.incomplete"}:
                        last_id = event["response"]["id"]
                        break


@pytest.mark.skipif(not CASES, reason="nothing recorded yet: AGENTS_RECORD=1 make test-agents")
@pytest.mark.parametrize("request_", CASES)
async def test_a_recorded_agent_request_succeeds(stack: Any, request_: dict[str, Any]) -> None:
    origin = stack.api_url.removesuffix("/v1")
    if request_.get("socket_messages"):
        await _replay_socket(origin, request_)
    else:
        await _replay_http(origin, request_)
