"""The edge's HTTP API under hostile input: generated from its own /openapi.json, plus limits.

schemathesis reads the OpenAPI document the edge serves and, for every
operation, sends bodies, paths and queries that follow the schema (positive)
and that break it (negative), seeded and bounded. Whatever it sends:

- no 500, ever: that is an unhandled exception in the edge;
- 502, 503 and 504 are allowed, as legitimate gateway answers (a provider
  failed, nothing available or the queue timed out, a provider timed out):
  well-formed bodies reach the mock providers, which can refuse them;
- every 4xx and 5xx body is an OpenAI error object
  ``{"error": {"message", "type", "param", "code"}}`` (``/healthz`` and
  ``/readyz`` answer load balancers in their own documented shape, the
  ``/v1/messages`` paths with Anthropic's ``{"type": "error", "error": ...}``);
- every stream is its API's: chat chunks ending with ``[DONE]``, Responses and
  Messages events each named by its ``event:`` line, in their order;
- schemathesis' own conformance checks hold: statuses, content types and
  response bodies are the ones the document declares, and schema-breaking
  input is refused with a 4xx.

Then by hand: a body over the edge's limit gets 413, and malformed JSON, or a
body in another format (form, multipart, text, XML), gets 400, each an OpenAI
error object. The edge judges the body, not the ``Content-Type`` header: a
JSON object sent as ``text/plain`` (``curl -d`` without ``-H``) is served.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CheckFunction
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from iop_edge.service.limits import DEFAULT_MAX_BODY_BYTES
from iop_edge.testing import BAD_BODIES

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_EXAMPLES = 30  # per operation and per generation mode
KNOWN_MODEL_EXAMPLES = 20  # positive inference bodies sent again with a model that exists
KNOWN_MODEL = "mock-small"
# The same cases every run (derandomized), so a fixed amount of work: about 80 s on this
# project's quiet 2-core machine, over the suite's 120 s default on a busy one.
CHILD_TIMEOUT_S = 270
# Probes for load balancers, not OpenAI routes: a 503 "not_ready" is their documented answer.
HEALTH_PROBES = ("GET /healthz", "GET /readyz")
INFERENCE = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/embeddings",
    "POST /v1/responses",
)
# Runtime control's changes (docs/ARCHITECTURE.md#runtime-control) are not fuzzed: the
# stack is shared, and a generated body that happened to name a real target ("state",
# "node-a", "disabled") would take a provider out of every later test's fleet. Their input
# checks are tested by hand (tests/faults/test_runtime_control.py); the listing is fuzzed.
NOT_FUZZED = ("POST /iop/v1/controls", "POST /iop/v1/controls/{change_id}/revert")
GATEWAY_STATUSES = frozenset({502, 503, 504})
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES  # the frame limit less its headroom
ERROR_FIELDS = {"message", "type", "param", "code"}
CONFORMANCE_CHECKS: list[CheckFunction] = [
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.negative_data_rejection,
]


STREAM_OBJECTS = ("chat.completion.chunk", "text_completion")
RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")


def openai_error_problem(status: int, body: bytes) -> str | None:
    """Why ``body`` is not an OpenAI error object, or ``None`` when it is one."""
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:120]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS:
        return f"{status} with a body that is not an OpenAI error object: {body[:200]!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"{status} with an error whose message or type is not a string: {error}"
    return None


def sse_problem(body: bytes, cut_short: bool) -> str | None:
    """Why a stream is not chunk objects (or an error object) ending with ``[DONE]``.

    schemathesis reads a long stream only up to a number of events and hangs up
    (``cut_short``): then only the events it kept are judged, not the ending.
    """
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    if cut_short:
        events = events[:-1]  # the last one may be cut in the middle
    elif not events or events[-1] != "[DONE]":
        return f"a stream that does not end with [DONE]: {body[-200:]!r}"
    for event in events:
        if event == "[DONE]":
            continue
        payload = json.loads(event)
        if "error" in payload:
            problem = openai_error_problem(200, event.encode())
            if problem is not None:
                return f"a stream's error event: {problem}"
        # OpenAI streams chat as chat.completion.chunk, legacy completions as text_completion
        elif payload.get("object") not in STREAM_OBJECTS or "choices" not in payload:
            return f"a stream event that is not a chunk: {event[:200]}"
    return None


def anthropic_error_problem(status: int, body: bytes) -> str | None:
    """Why ``body`` is not Anthropic's error object (the ``/v1/messages`` paths' errors)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:120]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if payload.get("type") != "error" or not isinstance(error, dict):
        return f"{status} with a body that is not an Anthropic error object: {body[:200]!r}"
    if not isinstance(error.get("type"), str) or not isinstance(error.get("message"), str):
        return f"{status} with an Anthropic error whose type or message is not a string: {error}"
    return None


def named_events(body: bytes, cut_short: bool) -> list[dict[str, Any]] | str:
    """The events of a stream whose every event has an ``event:`` line naming its data's
    type (Responses, Messages), or why it has not."""
    frames = [frame for frame in body.decode().split("\n\n") if frame]
    if cut_short:
        frames = frames[:-1]
    events = []
    for frame in frames:
        head, _, data = frame.partition("\n")
        if not head.startswith("event: ") or not data.startswith("data: "):
            return f"a stream frame without event: and data: lines: {frame[:200]!r}"
        payload = json.loads(data[len("data: ") :])
        if payload.get("type") != head[len("event: ") :]:
            return f"an event: line that does not name its data's type: {frame[:200]!r}"
        events.append(payload)
    return events


def messages_sse_problem(body: bytes, cut_short: bool) -> str | None:
    """Why a Messages stream is not Anthropic's: ``message_start`` first, ``message_stop``
    (or an ``error``) last."""
    events = named_events(body, cut_short)
    if isinstance(events, str):
        return events
    if events and events[0]["type"] != "message_start":
        return f"a Messages stream that starts with {events[0]['type']}"
    if not cut_short and (not events or events[-1]["type"] not in ("message_stop", "error")):
        return f"a Messages stream that does not end with message_stop: {body[-200:]!r}"
    return None


def responses_sse_problem(body: bytes, cut_short: bool) -> str | None:
    """Why a Responses stream is not OpenAI's: ``event:`` + ``data:`` per event, numbered
    from 0, ``response.created`` first, a terminal ``response.*`` event last, no ``[DONE]``."""
    events = named_events(body, cut_short)
    if isinstance(events, str):
        return events
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return "Responses events not numbered 0, 1, 2, ..."
    if events and events[0]["type"] != "response.created":
        return f"a Responses stream that starts with {events[0]['type']}"
    if not cut_short and (not events or events[-1]["type"] not in RESPONSES_ENDS):
        return f"a Responses stream that does not end with a terminal event: {body[-200:]!r}"
    return None


@dataclass
class Findings:
    """Every response schemathesis got, counted; every violation, kept."""

    statuses: Counter[str] = field(default_factory=Counter)
    cases: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    without_negative_cases: list[str] = field(default_factory=list)
    streams: int = 0  # SSE answers, their events checked by ``sse_problem``
    streams_cut_short: int = 0  # read only in part by schemathesis

    def judge(self, case: schemathesis.Case, response: schemathesis.Response, mode: str) -> None:
        status = response.status_code
        self.cases[mode] += 1
        self.statuses[f"{status // 100}xx" if status not in GATEWAY_STATUSES else str(status)] += 1
        label = f"{case.operation.label} ({mode})"
        if status >= 500 and status not in GATEWAY_STATUSES:
            self.problems.append(f"{label}: server error {status}: {response.content[:300]!r}")
        messages = case.operation.path.startswith("/v1/messages")
        if status >= 400 and case.operation.label not in HEALTH_PROBES:
            shape = anthropic_error_problem if messages else openai_error_problem
            problem = shape(status, response.content)
            if problem is not None:
                self.problems.append(f"{label}: {problem}")
        checks = CONFORMANCE_CHECKS
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            # The document gives a stream the schema {"type": "string"} (OpenAPI 3.1 has no
            # per-event schema); schemathesis reads it as each event's (3.2's itemSchema)
            # and would fail every stream. The events are checked here instead.
            checks = [c for c in checks if c is not openapi_checks.response_schema_conformance]
            self.streams += 1
            self.streams_cut_short += response.stream_cut_short
            judge = sse_problem
            if case.operation.label == "POST /v1/responses":
                judge = responses_sse_problem
            elif messages:
                judge = messages_sse_problem
            problem = judge(response.content, response.stream_cut_short)
            if problem is not None:
                self.problems.append(f"{label}: {problem}")
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:
            for failure in group.exceptions:
                self.problems.append(f"{label}: {failure.title}: {failure.message[:300]}")


def run_schemathesis(origin: str) -> Findings:
    """The whole run, blocking (schemathesis speaks ``requests``): the child process's work."""
    schema = schemathesis.openapi.from_url(f"{origin}/openapi.json", timeout=10)
    findings = Findings()
    with requests.Session() as session:
        session.trust_env = False  # no proxy from the environment: 127.0.0.1 only
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.label in NOT_FUZZED:
                continue
            for mode in (
                schemathesis.GenerationMode.POSITIVE,
                schemathesis.GenerationMode.NEGATIVE,
            ):
                probe_operation(operation, mode, origin, session, findings)
            if operation.label in INFERENCE:
                # a random model id is a 404 before anything else: these reach the providers
                probe_operation(
                    operation,
                    schemathesis.GenerationMode.POSITIVE,
                    origin,
                    session,
                    findings,
                    known_model=KNOWN_MODEL,
                )
    return findings


def probe_operation(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    origin: str,
    session: requests.Session,
    findings: Findings,
    known_model: str | None = None,
) -> None:
    """Up to ``MAX_EXAMPLES`` cases of one operation; every response is judged."""
    strategy = operation.as_strategy(generation_mode=mode)
    if known_model is not None:
        strategy = strategy.map(lambda case: with_model(case, known_model))

    @settings(
        max_examples=KNOWN_MODEL_EXAMPLES if known_model else MAX_EXAMPLES,
        derandomize=True,  # the same cases every run
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def probe(case: schemathesis.Case) -> None:
        response = case.call(base_url=origin, session=session, timeout=30)
        findings.judge(
            case, response, f"{mode.value}, {known_model}" if known_model else mode.value
        )

    try:
        probe()
    except Unsatisfiable:
        # nothing to break: an operation without parameters or body has no negative cases
        assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
        findings.without_negative_cases.append(operation.label)


def with_model(case: schemathesis.Case, model: str) -> schemathesis.Case:
    if isinstance(case.body, dict):
        case.body["model"] = model
    return case


async def findings_of_a_child_process(origin: str, out: Path) -> Findings:
    """``run_schemathesis`` in a Python process of its own, its findings read back as JSON.

    Not in a thread of the test's: hypothesis and schemathesis build and compile syntax
    trees, and CPython 3.11 keeps the AST constructor's recursion depth per interpreter,
    not per thread (python/cpython#106905), so on a loaded machine a generation in one
    thread beside pytest's work in another could end in ``SystemError: AST constructor
    recursion depth mismatch``, raised out of the hypothesis plugin as an INTERNALERROR
    that stopped the whole session. In a child, whatever goes wrong fails this test only,
    with the child's output as the reason.
    """
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        origin,
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            output, _ = await child.communicate()
    finally:
        # A run cut short must not outlive the test: the next test of this worker would
        # fail on its unclosed pipes.
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 0, f"the schemathesis run failed:\n{output.decode()[-4000:]}"
    saved = json.loads(await asyncio.to_thread(out.read_text))
    return Findings(
        statuses=Counter(saved["statuses"]),
        cases=Counter(saved["cases"]),
        problems=saved["problems"],
        without_negative_cases=saved["without_negative_cases"],
        streams=saved["streams"],
        streams_cut_short=saved["streams_cut_short"],
    )


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
async def test_generated_requests_get_no_500_and_only_openai_errors(
    stack: Any, report: Callable[[str], None], tmp_path: Path
) -> None:
    origin = stack.api_url.removesuffix("/v1")
    findings = await findings_of_a_child_process(origin, tmp_path / "findings.json")
    report(
        f"{sum(findings.cases.values())} generated requests {dict(findings.cases)}, "
        f"statuses {dict(findings.statuses)}, {len(findings.problems)} problems; "
        f"{findings.streams} of them SSE streams ({findings.streams_cut_short} read in part); "
        f"no negative cases for {findings.without_negative_cases}"
    )
    for problem, count in Counter(findings.problems).most_common(20):
        report(f"{count} x {problem}")
    assert not findings.problems


async def test_a_body_over_the_limit_gets_413(stack: Any, report: Callable[[str], None]) -> None:
    head = b'{"model": "mock-small", "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    body = head + b"a" * (MAX_BODY_BYTES + 1 - len(head) - len(tail)) + tail
    answers = {}
    async with aiohttp.ClientSession() as http:
        for route in ("chat/completions", "embeddings"):
            started = time.monotonic()
            async with http.post(
                f"{stack.api_url}/{route}",
                data=io.BytesIO(body),  # streamed, not one huge write
                headers={"Content-Type": "application/json"},
            ) as response:
                answers[route] = (response.status, await response.read())
            report(
                f"{len(body)} bytes to /v1/{route}: {response.status} "
                f"in {time.monotonic() - started:.2f}s"
            )
    for route, (status, payload) in answers.items():
        assert status == 413, (route, status, payload[:200])
        assert openai_error_problem(status, payload) is None
        assert json.loads(payload)["error"]["code"] == "request_too_large"


async def test_malformed_bodies_and_wrong_content_types_get_400_error_objects(
    stack: Any, report: Callable[[str], None]
) -> None:
    statuses: Counter[int] = Counter()
    async with aiohttp.ClientSession() as http:
        for route in ("chat/completions", "completions", "embeddings", "batches", "responses"):
            for name, (content_type, body) in BAD_BODIES.items():
                async with http.post(
                    f"{stack.api_url}/{route}", data=body, headers={"Content-Type": content_type}
                ) as response:
                    payload = await response.read()
                statuses[response.status] += 1
                assert response.status == 400, (route, name, response.status, payload[:200])
                assert openai_error_problem(400, payload) is None, (route, name)
                assert json.loads(payload)["error"]["type"] == "invalid_request_error"
        # the routing errors are error objects too
        for method, path, status in (
            ("GET", "/v1/chat/completions", 405),
            ("POST", "/v1/nowhere", 404),
            ("DELETE", "/v1/models", 405),
        ):
            async with http.request(method, stack.api_url.removesuffix("/v1") + path) as response:
                payload = await response.read()
            statuses[response.status] += 1
            assert response.status == status, (method, path, response.status)
            assert openai_error_problem(status, payload) is None, (method, path)
    report(f"{sum(statuses.values())} malformed requests: statuses {dict(statuses)}")


async def test_runtime_control_changes_refuse_bad_input_and_change_nothing(
    stack: Any, report: Callable[[str], None]
) -> None:
    """By hand what the fuzz leaves out (NOT_FUZZED): malformed bodies, wrong shapes and
    unknown targets or changes are error objects, and nothing was stored."""
    origin = stack.api_url.removesuffix("/v1")
    controls = f"{origin}/iop/v1/controls"
    refused: list[tuple[str, str | bytes, str, int]] = [
        (controls, body, content_type, 400) for content_type, body in BAD_BODIES.values()
    ]
    refused += [
        (controls, json.dumps(body), "application/json", status)
        for body, status in (
            ([], 400),
            ({"target": "node-a"}, 400),
            ({"kind": "state", "target": "node-a", "value": True}, 400),
            ({"kind": "restart", "target": "node-a", "value": "now"}, 400),
            ({"kind": "state", "target": "node-a", "value": "asleep"}, 400),
            ({"kind": "state", "target": "node-zz", "value": "disabled"}, 404),
            ({"kind": "prefer", "target": "no-such-model", "value": "node-a-mock"}, 404),
        )
    ]
    refused += [
        (f"{controls}/chg_nothex/revert", "{}", "application/json", 400),
        (f"{controls}/chg_000000000000/revert", "{}", "application/json", 404),
        (f"{controls}/chg_000000000000/revert", "[1]", "application/json", 400),
    ]
    async with aiohttp.ClientSession() as http:
        for url, body, content_type, status in refused:
            headers = {"Content-Type": content_type}
            async with http.post(url, data=body, headers=headers) as response:
                payload = await response.read()
            assert response.status == status, (url, body, response.status, payload[:200])
            assert openai_error_problem(status, payload) is None, (url, body)
        async with http.get(controls) as response:
            assert response.status == 200
            listing = await response.json()
    assert (listing["controls"], listing["audit"]) == ([], [])
    report(f"{len(refused)} bad runtime control changes refused, none stored")


if __name__ == "__main__":
    # ``python test_http_bad_input.py ORIGIN OUT``: the run of ``findings_of_a_child_process``
    found = run_schemathesis(sys.argv[1])
    saved = {
        name: dict(value) if isinstance(value, Counter) else value
        for name, value in vars(found).items()
    }
    Path(sys.argv[2]).write_text(json.dumps(saved))
