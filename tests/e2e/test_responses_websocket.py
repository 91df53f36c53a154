"""The Responses API's WebSocket mode (``GET /v1/responses`` upgraded) and
``POST /v1/responses/compact``, through a real edge, control-plane and mock nodes, with
aiohttp's WebSocket client: the events of each response (held to the same contract as
the SSE stream's), several responses on one socket, ``previous_response_id`` within the
connection with ``store: false``, warm-ups, the error events, authentication at the
upgrade, and a socket closed mid-response freeing the provider's slot.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py
MODEL = "mock-small"
HERE = Path(__file__).resolve().parent
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"iop_e2e_{name}", HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


contract = _load("test_responses_api")
openai_api = _load("test_openai_api")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def key(stack: Stack) -> str:
    """A key the edge knows (the API is then closed to callers without one)."""
    secret = await contract.issue_key(stack, "websocket")
    async with aiohttp.ClientSession() as http, asyncio.timeout(10):
        while True:
            headers = {"Authorization": f"Bearer {secret}"}
            async with http.get(f"{stack.api_url}/models", headers=headers) as reply:
                if reply.status == 200:
                    return str(secret)
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(loop_scope="module")
async def socket(stack: Stack, key: str) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.ws_connect(f"{stack.api_url}/responses", headers=headers) as ws:
            yield ws


async def create(ws: aiohttp.ClientWebSocketResponse, **body: Any) -> list[dict[str, Any]]:
    """Send one ``response.create`` and read its events up to the terminal one (or the
    one ``error`` event of a refused request)."""
    await ws.send_json({"type": "response.create", **body})
    return await events_until_done(ws)


async def events_until_done(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(20):
        while True:
            message = await ws.receive()
            assert message.type is aiohttp.WSMsgType.TEXT, message
            event = json.loads(message.data)
            events.append(event)
            if event["type"] in TERMINAL or (event["type"] == "error" and len(events) == 1):
                return events


async def test_a_response_streams_the_sse_events_as_text_frames(
    stack: Stack, key: str, socket: aiohttp.ClientWebSocketResponse
) -> None:
    events = await create(socket, model=MODEL, input="tell me something", max_output_tokens=6)
    contract.check_events(events)
    body = {"model": MODEL, "input": "tell me something", "max_output_tokens": 6, "stream": True}
    over_http = await contract.sse(stack, key, body)
    assert [e["type"] for e in events] == [e["type"] for e in over_http]
    final = events[-1]["response"]
    assert final["status"] == "incomplete"  # the mock's answer is cut at max_output_tokens
    assert final["usage"]["output_tokens"] == 6
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text != ""


async def test_responses_follow_one_another_and_continue_with_store_false(
    stack: Stack, key: str, socket: aiohttp.ClientWebSocketResponse
) -> None:
    first = await create(socket, model=MODEL, input="one two three", store=False)
    contract.check_events(first)
    first_id = first[-1]["response"]["id"]
    second = await create(
        socket,
        model=MODEL,
        input=[{"role": "user", "content": "four"}],
        previous_response_id=first_id,
        store=False,
        max_output_tokens=3,
    )
    contract.check_events(second)
    final = second[-1]["response"]
    assert final["previous_response_id"] == first_id
    # The mock counts the words it was sent: the first turn's input and answer, then "four".
    first_final = first[-1]["response"]
    answer_words = len(first_final["output"][0]["content"][0]["text"].split())
    assert final["usage"]["input_tokens"] == 3 + answer_words + 1
    # Not stored: over HTTP (and on another socket) the id is unknown.
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": "five", "previous_response_id": first_id}
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            assert reply.status == 404
            assert (await reply.json())["error"]["code"] == "previous_response_not_found"
        async with http.ws_connect(f"{stack.api_url}/responses", headers=headers) as other:
            (error,) = await create(other, **body, store=False)
            assert error["type"] == "error"
            assert error["status"] == 404
            assert error["error"]["code"] == error["code"] == "previous_response_not_found"
            assert error["param"] == "previous_response_id"
            # The recovery Codex makes: the whole conversation again, on the same socket.
            again = await create(other, model=MODEL, input="one two three four", store=False)
            assert again[-1]["type"] == "response.completed"


async def test_a_stored_response_continues_on_a_socket_too(
    key: str, socket: aiohttp.ClientWebSocketResponse, stack: Stack
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": "stored words", "max_output_tokens": 2}
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            stored = await reply.json()
    follow = await create(
        socket, model=MODEL, input="more", previous_response_id=stored["id"], max_output_tokens=2
    )
    answer_words = len(stored["output"][0]["content"][0]["text"].split())
    assert follow[-1]["response"]["usage"]["input_tokens"] == 2 + answer_words + 1


async def test_a_warm_up_answers_without_output_and_is_continued(
    socket: aiohttp.ClientWebSocketResponse,
) -> None:
    warm = await create(
        socket,
        model=MODEL,
        instructions="be brief",
        input=[{"role": "user", "content": "alpha beta gamma"}],
        store=False,
        generate=False,
    )
    assert [e["type"] for e in warm] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in warm] == [0, 1, 2]
    final = warm[-1]["response"]
    contract.check_response(final)
    assert final["output"] == []
    turn = await create(
        socket,
        model=MODEL,
        instructions="be brief",
        input=[],
        previous_response_id=final["id"],
        store=False,
        max_output_tokens=2,
    )
    contract.check_events(turn)
    assert turn[-1]["response"]["usage"]["input_tokens"] == 2 + 3  # instructions, then input


async def test_bad_client_events_get_error_events_and_the_socket_goes_on(
    socket: aiohttp.ClientWebSocketResponse,
) -> None:
    await socket.send_str("{not json")
    (error,) = await events_until_done(socket)
    assert (error["type"], error["status"]) == ("error", 400)
    assert error["error"]["type"] == "invalid_request_error"
    await socket.send_str('{"type": "response.create", "model": "mock-small", "top_p": NaN}')
    (error,) = await events_until_done(socket)  # not JSON, as over HTTP
    assert error["status"] == 400
    await socket.send_json({"type": "session.update"})
    (error,) = await events_until_done(socket)
    assert error["param"] == "type"
    await socket.send_bytes(b"{}")
    (error,) = await events_until_done(socket)
    assert error["status"] == 400
    (error,) = await create(socket, model="no-such-model", input="x")
    assert (error["status"], error["code"]) == (404, "model_not_found")
    (error,) = await create(socket, model=MODEL)
    assert error["param"] == "input"
    await socket.send_json({"type": "response.processed", "response_id": "resp_x"})  # Codex's
    done = await create(socket, model=MODEL, input="still here", max_output_tokens=2)
    assert done[-1]["type"] == "response.incomplete"


async def test_a_second_create_while_one_runs_is_refused(
    socket: aiohttp.ClientWebSocketResponse,
) -> None:
    await socket.send_json(
        {"type": "response.create", "model": MODEL, "input": "long", "max_output_tokens": 200}
    )
    first = await socket.receive_json()
    assert first["type"] == "response.created"
    await socket.send_json({"type": "response.create", "model": MODEL, "input": "again"})
    events = await events_until_done(socket)
    errors = [e for e in events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["conversation_already_has_active_response"]
    assert events[-1]["type"] == "response.completed"  # the first one ran on, untouched
    assert events[-1]["response"]["usage"]["output_tokens"] == 32  # the mock's whole answer


async def test_closing_the_socket_mid_response_frees_the_slot(stack: Stack, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{stack.api_url}/responses", headers=headers)
        await ws.send_json(
            {"type": "response.create", "model": "solo", "input": "x", "max_output_tokens": 30_000}
        )
        async with asyncio.timeout(10):
            while (await ws.receive_json())["type"] != "response.output_text.delta":
                pass  # the run is going
        assert await in_flight(stack, key, "node-a-solo") == 1
        await ws.close()
    async with asyncio.timeout(10):
        while await in_flight(stack, key, "node-a-solo") != 0:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)
    await openai_api.eventually(
        lambda: openai_api._node_in_flight(stack, "node-a", "node-a-solo", 0)
    )
    runs_url = stack.api_url.replace("/v1", "/iop/v1/runs")
    async with aiohttp.ClientSession() as http:
        async with http.get(runs_url, headers=headers) as reply:
            runs = (await reply.json())["data"]
    solo = [run for run in runs if run["model"] == "solo"]
    assert solo[0]["outcome"] == "cancelled", solo[0]


async def in_flight(stack: Stack, key: str, provider_id: str) -> int:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as reply:
            rows = {row["provider_id"]: row for row in (await reply.json())["data"]}
    return int(rows[provider_id]["in_flight"])


async def test_the_upgrade_needs_the_api_key(stack: Stack, key: str) -> None:
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer sk-iop-wrong"}, {"x-api-key": "nope"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"{stack.api_url}/responses", headers=headers)
            assert refused.value.status == 401
        async with http.ws_connect(f"{stack.api_url}/responses", headers={"x-api-key": key}) as ws:
            events = await create(ws, model=MODEL, input="anthropic-style key", max_output_tokens=1)
            assert events[-1]["type"] == "response.incomplete"
        async with http.get(
            f"{stack.api_url}/responses", headers={"Authorization": f"Bearer {key}"}
        ) as plain:
            assert plain.status == 426
            assert (await plain.json())["error"]["code"] == "upgrade_required"


# -- POST /v1/responses/compact ------------------------------------------------------------

CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "what is the weather in Paris"},
    {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    {"role": "user", "content": "thanks"},
]


async def compact(stack: Stack, key: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{stack.api_url}/responses/compact", json=body, headers=headers
        ) as reply:
            answer: dict[str, Any] = await reply.json()
            assert reply.status == 200, answer
            return answer


async def test_compact_answers_a_compaction_that_later_requests_take(
    stack: Stack, key: str
) -> None:
    answer = await compact(
        stack,
        key,
        {
            "model": MODEL,
            "instructions": "You are a coding agent.",
            "input": CONVERSATION,
            "tools": [{"type": "web_search"}],  # Codex sends its tools; not the summary's
            "parallel_tool_calls": False,
            "max_output_tokens": 7,
        },
    )
    assert re.fullmatch(r"resp_\S+", answer["id"])
    assert answer["object"] == "response.compaction"
    assert isinstance(answer["created_at"], int)
    *kept, item = answer["output"]
    assert [(m["role"], m["content"][0]["text"]) for m in kept] == [
        ("user", "what is the weather in Paris"),
        ("user", "thanks"),
    ]
    assert item["type"] == "compaction"
    assert item["id"].startswith("cmp_")
    assert isinstance(item["encrypted_content"], str)
    assert contract.REQUIRED["ResponseUsage"] <= answer["usage"].keys()
    assert answer["usage"]["output_tokens"] == 7  # the mock's summary: 7 words
    assert answer["usage"]["input_tokens"] > 20  # instructions to summarise, and the transcript
    # A later request takes the compacted history: the summary's words reach the model.
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        body = {
            "model": MODEL,
            "input": [*answer["output"], {"role": "user", "content": "and tomorrow"}],
            "max_output_tokens": 1,
        }
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            follow = await reply.json()
            assert reply.status == 200, follow
    sealed = item["encrypted_content"].removeprefix("iop-compaction-v1:")
    summary = base64.b64decode(sealed).decode()
    header = "Summary of the conversation so far:"
    # The kept user messages, the summary under its header, then the new message.
    words = 6 + 1 + len(header.split()) + len(summary.split()) + 2
    assert follow["usage"]["input_tokens"] == words


async def test_compact_continues_a_stored_response_and_accepts_foreign_items(
    stack: Stack, key: str
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": "remember this", "max_output_tokens": 2}
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            stored = await reply.json()
    answer = await compact(
        stack,
        key,
        {
            "model": MODEL,
            "previous_response_id": stored["id"],
            "input": [
                {"type": "compaction", "encrypted_content": "gAAAAABforeign"},  # OpenAI's
                {"role": "user", "content": "go on"},
            ],
            "max_output_tokens": 3,
        },
    )
    *kept, item = answer["output"]
    assert [m["content"][0]["text"] for m in kept] == ["remember this", "go on"]
    assert item["type"] == "compaction"
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        bad = {"model": MODEL, "input": "x", "stream": True}
        async with http.post(
            f"{stack.api_url}/responses/compact", json=bad, headers=headers
        ) as reply:
            assert reply.status == 400
            assert (await reply.json())["error"]["param"] == "stream"


async def test_a_compaction_trigger_turn_answers_one_compaction_item(
    stack: Stack, key: str, socket: aiohttp.ClientWebSocketResponse
) -> None:
    """Codex's remote compaction v2: the conversation then ``compaction_trigger``, in a
    normal response (here on a socket, over SSE, and not streamed)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "input": [*CONVERSATION, {"type": "compaction_trigger"}],
        "tools": [{"type": "web_search"}],
        "store": False,
        "max_output_tokens": 5,
    }
    kinds = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    on_socket = await create(socket, **body)
    over_sse = await contract.sse(stack, key, {**body, "stream": True})
    for events in (on_socket, over_sse):
        assert [e["type"] for e in events] == kinds
        assert [e["sequence_number"] for e in events] == list(range(5))
        final = events[-1]["response"]
        assert contract.REQUIRED["Response"] <= final.keys()
        assert isinstance(final["completed_at"], int)  # completed: the spec wants it set
        assert events[-1]["sequence_number"] == 4
        (item,) = final["output"]
        assert events[3]["item"] == item
        assert item["type"] == "compaction"
        assert item["id"] == final["id"].replace("resp_", "cmp_")
        assert final["usage"]["output_tokens"] == 5  # the summary
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            whole = await reply.json()
            assert reply.status == 200, whole
    assert whole["object"] == "response"
    assert isinstance(whole["completed_at"], int)  # completed: the spec wants it set
    assert [item["type"] for item in whole["output"]] == ["compaction"]
    # The next turn sends the compaction back: its summary reaches the model.
    follow = await create(
        socket,
        model=MODEL,
        input=[whole["output"][0], {"role": "user", "content": "next"}],
        store=False,
        max_output_tokens=1,
    )
    assert follow[-1]["response"]["usage"]["input_tokens"] == 6 + 5 + 1
