"""run_check.resolve(): the run request must fit the provider it names (converted at the rim by
``wire.run_order``, as the link does); the body is parsed at most once, a prepared one never."""

from __future__ import annotations

import json

import pytest

from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.entrypoints import wire
from iop_node.errors import InvalidRequest, UnknownProvider
from iop_node.service.run_check import resolve
from iop_proto.v1 import runtime_pb2 as pb

PROVIDERS = {
    "p1": ProviderConfig(
        id="p1", type="vllm", models=("Qwen/Q", "other"), request_timeout_ms=60_000
    )
}


def request(**changes: object) -> pb.RunRequest:
    fields: dict[str, object] = {
        "run_id": "r1",
        "model": "qwen:35b",
        "provider_id": "p1",
        "adapter": "vllm",
        "target": "Qwen/Q",
        "operation": pb.OPERATION_CHAT_COMPLETIONS,
        "body_json": json.dumps({"model": "Qwen/Q", "messages": [], "seed": 3}).encode(),
        "stream": True,
    }
    fields.update(changes)
    return pb.RunRequest(**fields)  # type: ignore[arg-type]


def resolve_on_p1(message: pb.RunRequest, *, loop_now: float, unix_now_ms: int) -> ExecutionSpec:
    """What the node does: look up the provider the request names, then resolve."""
    config = PROVIDERS.get(message.provider_id)
    return resolve(wire.run_order(message), config, loop_now=loop_now, unix_now_ms=unix_now_ms)


def test_a_fitting_request_becomes_a_spec() -> None:
    spec = resolve_on_p1(request(), loop_now=100.0, unix_now_ms=1_000_000)
    assert spec.provider_id == "p1"
    assert spec.adapter == "vllm"
    assert spec.operation is Operation.CHAT_COMPLETIONS
    assert spec.body == {"model": "Qwen/Q", "messages": [], "seed": 3}
    assert spec.model == "qwen:35b"
    assert spec.target == "Qwen/Q"
    assert spec.deadline == pytest.approx(160.0)  # the provider's request timeout


def test_the_edge_deadline_wins_when_earlier() -> None:
    spec = resolve_on_p1(request(deadline_unix_ms=1_005_000), loop_now=100.0, unix_now_ms=1_000_000)
    assert spec.deadline == pytest.approx(105.0)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"provider_id": "nope"}, UnknownProvider, "no provider 'nope'"),
        ({"adapter": "ollama"}, InvalidRequest, "of type 'vllm', not 'ollama'"),
        ({"target": "qwen:35b"}, InvalidRequest, "does not serve 'qwen:35b'"),
        ({"body_json": b"{not json"}, InvalidRequest, "not JSON"),
        ({"body_json": b"[1, 2]"}, InvalidRequest, "must be a JSON object"),
        ({"body_json": b"[" * 100_000}, InvalidRequest, "not JSON"),  # not a RecursionError
        ({"operation": pb.OPERATION_UNSPECIFIED}, InvalidRequest, "unsupported operation"),
        ({"run_id": ""}, InvalidRequest, "without a run id"),
    ],
)
def test_requests_that_do_not_fit_are_refused(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        resolve_on_p1(request(**changes), loop_now=0.0, unix_now_ms=0)


def test_the_node_never_rewrites_the_model() -> None:
    """The edge writes the served name (docs/ARCHITECTURE.md#target-rewrite): what it sent
    is what runs, byte for byte; the node no longer writes the model a second time."""
    body = json.dumps({"model": "qwen:35b", "messages": []}).encode()
    spec = resolve_on_p1(request(body_json=body), loop_now=0.0, unix_now_ms=0)
    assert spec.body["model"] == "qwen:35b"
    assert spec.body_json == body


def test_a_prepared_body_stays_bytes_until_an_adapter_reads_it() -> None:
    """An order the edge prepared is not parsed by the node's checks: a body an adapter
    posts as it came is never parsed; the prompt's hashes come with it."""
    raw = b'{"model":"Qwen/Q","messages":[],"stream":true}'
    message = request(body_json=raw, body_prepared=True, prompt_blocks=[7, 9])
    spec = resolve_on_p1(message, loop_now=0.0, unix_now_ms=0)
    assert (spec.body_prepared, spec.body_json, spec.prompt_blocks) == (True, raw, (7, 9))
    assert spec.parsed is None  # not parsed by the checks
    assert spec.body == {"model": "Qwen/Q", "messages": [], "stream": True}  # on first use
    assert spec.parsed is spec.body  # once


def test_a_prepared_body_that_is_not_json_fails_where_it_is_read() -> None:
    spec = resolve_on_p1(
        request(body_json=b"{not json", body_prepared=True), loop_now=0.0, unix_now_ms=0
    )
    with pytest.raises(InvalidRequest, match="not JSON"):
        _ = spec.body


def test_an_older_edges_order_is_parsed_up_front_and_carries_no_hashes() -> None:
    spec = resolve_on_p1(request(prompt_blocks=[7]), loop_now=0.0, unix_now_ms=0)
    assert spec.body_prepared is False
    assert spec.parsed == {"model": "Qwen/Q", "messages": [], "seed": 3}
    assert spec.prompt_blocks is None  # the node hashes the body itself


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # What the fast parser refuses but the standard one reads, as the node always did.
        (b'\xef\xbb\xbf{"seed": 1}', {"seed": 1}),
        ('{"seed": 1}'.encode("utf-16"), {"seed": 1}),
        (b'{"messages": [{"content": "cut \\ud83d"}]}', {"messages": [{"content": "cut \ud83d"}]}),
        (b'{"seed": -9223372036854775808}', {"seed": -(2**63)}),
    ],
)
def test_bodies_only_the_standard_parser_reads_still_run(raw: bytes, expected: object) -> None:
    spec = resolve_on_p1(request(body_json=raw), loop_now=0.0, unix_now_ms=0)
    assert spec.body == expected
