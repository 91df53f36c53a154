"""The Responses dialect and the stored-response routes over a small in-memory store:
what is kept (and for whom), how a chain is continued, how errors name Responses' fields,
and the routes that read, list and delete, served for real on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from iop_edge.domain.events import Completed, Delta, Usage
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_dialect import Dialect
from iop_edge.entrypoints.api_gate import api_gate
from iop_edge.entrypoints.http_api import load_openapi
from iop_edge.entrypoints.responses_dialect import ResponsesDialect, conversation
from iop_edge.entrypoints.responses_routes import ResponsesRoutes
from iop_edge.errors import InvalidRequest, NotFound, StorageQuotaExceeded
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.ports import StoredResponse
from iop_edge.testing import MemoryResponseStore
from iop_proto import json_codec
from iop_proto.testing import loopback_app

MemoryStore = MemoryResponseStore


class Keys:
    """A ``KeyRing`` of two keys, ``sk-a`` and ``sk-b``."""

    configured = True  # a fleet config has arrived
    open = False

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        name = {"sk-a": "key_a", "sk-b": "key_b"}.get(presented_key)
        return None if name is None else ApiKeyEntry(name, name, "", frozenset(), 0)


KEY_A = ApiKeyEntry("key_a", "a", "", frozenset(), 0)
KEY_B = ApiKeyEntry("key_b", "b", "", frozenset(), 0)


async def answered(
    dialect: ResponsesDialect, body: dict[str, Any], run_id: str, key: ApiKeyEntry = KEY_A
) -> dict[str, Any]:
    """One non-streamed request through the dialect, the run saying ``run_id``'s words."""
    asked = await dialect.resolve(dialect.read(body), key)
    deltas = [Delta(text=f"said {run_id}")]
    raw = await dialect.answer(asked, Completed("stop", Usage(1, 2, 3)), deltas, run_id, 100)
    answer: dict[str, Any] = json_codec.loads(raw)
    return answer


async def test_an_answer_is_kept_for_its_key_and_continues_a_chain() -> None:
    store = MemoryStore()
    dialect = ResponsesDialect(store, ReasoningSeal.generate())
    first = await answered(dialect, {"model": "m", "input": "one"}, "r1")
    assert first["id"] == "resp_r1"
    assert first["output"][0]["id"] == "msg_r1"
    kept = store.rows["resp_r1"]
    assert kept.key_id == "key_a"
    assert json_codec.loads(kept.response_json) == first
    assert json_codec.loads(kept.input_json) == [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "one"}],
            "id": "msg_r1_0",
        }
    ]
    body = {"model": "m", "input": "two", "previous_response_id": "resp_r1", "instructions": "s"}
    asked = await dialect.resolve(dialect.read(body), KEY_A)
    assert [m["content"] for m in asked.spec.body["messages"]] == ["s", "one", "said r1", "two"]
    with pytest.raises(NotFound) as info:
        await dialect.resolve(dialect.read(body), KEY_B)  # another key's response
    assert info.value.param == "previous_response_id"
    await answered(dialect, body, "r2")
    second = store.rows["resp_r2"]  # its own input only, linked to the turn it continues
    assert [item["id"] for item in json_codec.loads(second.input_json)] == ["msg_r2_0"]
    assert (second.previous_id, second.depth) == ("resp_r1", 1)
    chain = await store.chain("resp_r2", "key_a")
    assert chain is not None
    assert [item["id"] for item in conversation(chain)] == [
        "msg_r1_0",
        "msg_r1",
        "msg_r2_0",
        "msg_r2",
    ]


async def test_store_false_keeps_nothing() -> None:
    store = MemoryStore()
    answer = await answered(
        ResponsesDialect(store, ReasoningSeal.generate()),
        {"model": "m", "input": "x", "store": False},
        "r",
    )
    assert answer["store"] is False
    assert store.rows == {}


async def test_a_streamed_answer_is_kept_when_it_ends() -> None:
    store = MemoryStore()
    dialect = ResponsesDialect(store, ReasoningSeal.generate())
    asked = await dialect.resolve(dialect.read({"model": "m", "input": "x", "stream": True}), None)
    assert asked.spec.stream
    assert asked.spec.include_usage
    writer = dialect.stream_writer(asked, "r9", 100)
    writer.opening()
    writer.delta(Delta(text="hi"))
    assert store.rows == {}
    writer.closing(Completed("stop", Usage(1, 1, 2)))
    assert store.rows == {}  # kept when the last events are about to leave
    await writer.settle()
    kept = json_codec.loads(store.rows["resp_r9"].response_json)
    assert kept["status"] == "completed"
    assert kept["output"][0]["content"][0]["text"] == "hi"
    assert store.rows["resp_r9"].key_id == ""  # the open API's


def test_errors_about_the_chat_body_name_the_responses_field() -> None:
    dialect = ResponsesDialect(MemoryStore(), ReasoningSeal.generate())
    error = InvalidRequest("max_tokens is too large: 99.", param="max_tokens", code="invalid_value")
    body = json.loads(dialect.error_response(error).text or "")
    assert body["error"]["param"] == "max_output_tokens"
    assert body["error"]["message"] == "max_output_tokens is too large: 99."
    assert error.param == "max_tokens"  # the original is left as it was


@contextlib.asynccontextmanager
async def serve(store: MemoryStore) -> AsyncIterator[str]:
    async def not_served(request: web.Request) -> web.StreamResponse:
        raise AssertionError("POST /v1/responses is the run pipeline's (not tested here)")

    class Pipeline:  # InferenceRoutes' face, for routes that never reach it here
        def route(self, dialect: Dialect) -> Any:
            return not_served

    app = web.Application(middlewares=[api_gate(Keys())])
    ResponsesRoutes(store, Keys(), ReasoningSeal.generate(), 1 << 20).register(
        app, cast(Any, Pipeline())
    )
    async with loopback_app(app) as port:
        yield f"http://127.0.0.1:{port}/v1/responses"


async def test_the_routes_read_list_and_delete_only_the_owner_s_responses() -> None:
    store = MemoryStore()
    items = [
        {"id": f"item_{i}", "type": "message", "role": "user", "content": []} for i in range(5)
    ]
    await store.keep(
        StoredResponse("resp_1", "key_a", 1, b'{"id":"resp_1"}', json_codec.dumps(items))
    )
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b"))
    async with serve(store) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/resp_1", headers=a) as reply:
            assert reply.status == 200
            assert await reply.json() == {"id": "resp_1"}
        for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
            async with http.request(method, f"{url}/resp_1{path}", headers=b) as reply:
                assert reply.status == 404
                assert (await reply.json())["error"]["message"] == (
                    "Response with id 'resp_1' not found."
                )
        async with http.get(f"{url}/resp_1/input_items?limit=2", headers=a) as reply:
            page = await reply.json()
        assert [i["id"] for i in page["data"]] == ["item_4", "item_3"]
        assert (page["first_id"], page["last_id"], page["has_more"]) == ("item_4", "item_3", True)
        query = "order=asc&after=item_2&limit=5"
        async with http.get(f"{url}/resp_1/input_items?{query}", headers=a) as reply:
            page = await reply.json()
        assert [i["id"] for i in page["data"]] == ["item_3", "item_4"]
        assert page["has_more"] is False
        for bad in ("limit=0", "limit=101", "order=up"):
            async with http.get(f"{url}/resp_1/input_items?{bad}", headers=a) as reply:
                assert reply.status == 400
        async with http.delete(f"{url}/resp_1", headers=a) as reply:
            assert await reply.json() == {"id": "resp_1", "object": "response", "deleted": True}
        async with http.get(f"{url}/resp_1", headers=a) as reply:
            assert reply.status == 404


def test_every_responses_route_is_in_the_openapi_document() -> None:
    documented = load_openapi()["paths"]
    expected = {
        ("/v1/responses", "post"),
        ("/v1/responses", "get"),  # its WebSocket mode
        ("/v1/responses/compact", "post"),
        ("/v1/responses/{response_id}", "get"),
        ("/v1/responses/{response_id}", "delete"),
        ("/v1/responses/{response_id}/input_items", "get"),
    }
    assert {(path, method) for path, method in expected if method in documented.get(path, {})} == (
        expected
    )


async def test_a_conversation_past_its_turn_bound_is_refused_before_it_runs() -> None:
    store = MemoryStore(max_depth=2)
    dialect = ResponsesDialect(store, ReasoningSeal.generate())
    previous = None
    for n in range(3):  # depths 0, 1, 2
        body = {"model": "m", "input": f"turn {n}"}
        if previous is not None:
            body["previous_response_id"] = previous
        previous = (await answered(dialect, body, f"t{n}"))["id"]
    assert store.rows["resp_t2"].depth == 2
    body = {"model": "m", "input": "one more", "previous_response_id": "resp_t2"}
    with pytest.raises(InvalidRequest) as info:
        await dialect.resolve(dialect.read(body), KEY_A)
    assert (info.value.code, info.value.param) == ("conversation_too_long", "previous_response_id")
    store.max_depth = 1  # a bound lowered after the chain grew: refused the same way
    with pytest.raises(InvalidRequest, match="compact it"):
        await dialect.resolve(dialect.read(body), KEY_A)


async def test_store_true_past_the_key_s_quota_is_refused_and_store_false_runs() -> None:
    store = MemoryStore(quota_bytes=2000)
    dialect = ResponsesDialect(store, ReasoningSeal.generate())
    await answered(dialect, {"model": "m", "input": "x" * 900}, "q1")
    with pytest.raises(StorageQuotaExceeded):
        await dialect.resolve(dialect.read({"model": "m", "input": "x" * 1500}), KEY_A)
    asked = await dialect.resolve(
        dialect.read({"model": "m", "input": "x" * 1500, "store": False}), KEY_A
    )
    assert asked.spec.body["messages"][-1]["content"] == "x" * 1500
