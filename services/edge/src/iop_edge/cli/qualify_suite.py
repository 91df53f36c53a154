"""``iopctl qualify``'s suite, run against one provider of a model through the pool
(docs/ARCHITECTURE.md#qualification-reports).

Every request goes to the edge's public API like any client's, pinned to the provider
by the operator's ``x-iop-provider`` header: what is measured is what a client of the
pool gets from that provider (the edge's queue and the node included). The suite:

- performance at each concurrency level: time to first token (p50), tokens/s of one
  stream (p50 of each stream's decode rate) and in aggregate (every stream's tokens
  over the level's wall time);
- the context reached: the prompt grows (doubling) until the provider refuses it as
  too long, the model's declared context window is reached, or the time bound passes;
- a tool call and a JSON-schema answer, validated (``qualify_checks``);
- determinism: one prompt at temperature 0, N times: how many distinct answers;
- the lifecycle flags the node claims, checked where the node observes them.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import aiohttp

from iop_edge.cli.edge_client import CtlError, EdgeClient, Row
from iop_edge.cli.qualify_checks import (
    Verdict,
    json_schema_body,
    judge_json_schema,
    judge_tool_call,
    tool_call_body,
)

PIN_HEADER: Final = "x-iop-provider"
KIND: Final = "iop.qualification/v1"
CONTEXT_START_WORDS: Final = 256
CONTEXT_MAX_WORDS: Final = 131_072  # ~128k tokens: where a model without a declared window stops
CONTEXT_BISECTIONS: Final = 4  # after the first refusal: the limit within 1/16 of the last step
CONTEXT_MARGIN: Final = 64  # below the declared window: the chat template's tokens, one output
DETERMINISM_PROMPT: Final = "List the first five planets of the solar system, one per line."


@dataclass(frozen=True, slots=True)
class SuiteOptions:
    levels: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 64
    rounds: int = 2  # requests per stream at each level
    determinism_runs: int = 5
    context_timeout_s: float = 120.0
    request_timeout_s: float = 300.0


@dataclass
class Probe:
    """One request's answer: its status, its JSON (non-streamed), its error code."""

    status: int
    body: dict[str, Any]

    @property
    def error(self) -> str:
        error = self.body.get("error") or {}
        return f"HTTP {self.status}: {str(error.get('message') or self.body)[:160]}"

    @property
    def code(self) -> str:
        return str((self.body.get("error") or {}).get("code") or "")


class PinnedClient:
    """Requests of the public API pinned to one provider."""

    def __init__(self, client: EdgeClient, pin: str, options: SuiteOptions) -> None:
        self._session = client.session
        self._url = client.url
        self._headers = {**client.headers, PIN_HEADER: pin}
        self._timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)

    async def chat(self, body: dict[str, Any], timeout_s: float | None = None) -> Probe:
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.post(
                f"{self._url}/v1/chat/completions",
                json=body,
                headers=self._headers,
                timeout=timeout,
            ) as response:
                text = await response.text()
        except aiohttp.ClientError as exc:
            raise CtlError(f"cannot reach the edge at {self._url}: {exc}") from exc
        except TimeoutError:
            seconds = timeout.total or 0
            return Probe(0, {"error": {"message": f"no answer within {seconds:.0f} s"}})
        try:
            document = json.loads(text)
        except ValueError:
            document = {"error": {"message": text[:200]}}
        return Probe(response.status, document if isinstance(document, dict) else {})

    async def stream(self, body: dict[str, Any]) -> dict[str, Any]:
        """A streamed answer's timings: seconds to the first token, seconds in all, its
        completion tokens (the usage chunk's; the chunks counted when it sends none)."""
        started = time.monotonic()
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            return await self._stream(request, started)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return {"error": f"the stream failed: {exc!r}"}

    async def _stream(self, request: dict[str, Any], started: float) -> dict[str, Any]:
        first = 0.0
        chunks = 0
        tokens = 0
        async with self._session.post(
            f"{self._url}/v1/chat/completions",
            json=request,
            headers=self._headers,
            timeout=self._timeout,
        ) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.text())[:160]}"}
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        first = first or time.monotonic() - started
        return {"ttft_s": first, "total_s": time.monotonic() - started, "tokens": tokens or chunks}


async def performance(
    pinned: PinnedClient, model: str, options: SuiteOptions, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    rows = []
    for level in options.levels:
        say(f"  concurrency {level}: {level * options.rounds} requests")

        async def stream_of(worker: int) -> list[dict[str, Any]]:
            results = []
            for n in range(options.rounds):
                body = {
                    "model": model,
                    "messages": [
                        {
                            "role": "user",
                            "content": f"Write a short story about robot number {worker}-{n}.",
                        }
                    ],
                    "max_tokens": options.max_tokens,
                    "temperature": 0.7,
                }
                results.append(await pinned.stream(body))
            return results

        started = time.monotonic()
        batches = await asyncio.gather(*(stream_of(w) for w in range(level)))
        wall = time.monotonic() - started
        done = [r for batch in batches for r in batch if "error" not in r]
        failed = [r["error"] for batch in batches for r in batch if "error" in r]
        ttfts = [r["ttft_s"] for r in done if r["ttft_s"]]
        rates = [
            (r["tokens"] - 1) / (r["total_s"] - r["ttft_s"])
            for r in done
            if r["tokens"] > 1 and r["total_s"] > r["ttft_s"] > 0
        ]
        tokens = sum(r["tokens"] for r in done)
        rows.append(
            {
                "concurrency": level,
                "requests": level * options.rounds,
                "failed": len(failed),
                "first_failure": failed[0] if failed else "",
                "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
                "tokens_per_s_single": round(statistics.median(rates), 2) if rates else None,
                "tokens_per_s_aggregate": round(tokens / wall, 2) if wall > 0 else None,
                "completion_tokens": tokens,
                "wall_s": round(wall, 2),
            }
        )
    return rows


async def context_reached(
    pinned: PinnedClient, model: str, declared: int, options: SuiteOptions
) -> dict[str, Any]:
    """Grow a prompt (one word a token, about), doubling, until refused as too long, the
    declared window, or the time bound; after a refusal, halve the gap between the longest
    accepted and the shortest refused prompt ``CONTEXT_BISECTIONS`` times (time allowing).
    The longest accepted prompt's tokens as the engine counted them."""
    deadline = time.monotonic() + options.context_timeout_s
    ceiling = declared - CONTEXT_MARGIN if declared > CONTEXT_MARGIN else CONTEXT_MAX_WORDS
    words, accepted = min(CONTEXT_START_WORDS, ceiling), 0
    reached, refused_at, stopped = 0, None, "time bound"
    bisections = 0
    while (left := deadline - time.monotonic()) > 0:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "word " * words + "\nSay ok."}],
            "max_tokens": 1,
            "temperature": 0,
        }
        probe = await pinned.chat(body, timeout_s=left)
        if probe.status == 0 and time.monotonic() >= deadline:
            break  # the time bound, mid-request
        if probe.status == 200:
            reached = int((probe.body.get("usage") or {}).get("prompt_tokens") or words)
            accepted = words
            if refused_at is None and words >= ceiling:
                stopped = "declared context window" if declared else "largest prompt tried"
                break
        elif probe.code == "context_length_exceeded":
            refused_at, stopped = words, "context overflow"
        else:
            stopped = f"error: {probe.error}"
            break
        if refused_at is None:
            words = min(words * 2, ceiling)
            continue
        if bisections == CONTEXT_BISECTIONS or refused_at - accepted <= 1:
            break
        bisections += 1
        words = (accepted + refused_at) // 2
    return {
        "declared": declared or None,
        "reached_tokens": reached,
        "refused_at_words": refused_at,
        "stopped": stopped,
    }


async def checked(pinned: PinnedClient, body: dict[str, Any], judge: Any) -> Verdict:
    probe = await pinned.chat(body)
    if probe.status != 200:
        return Verdict(False, f"the provider refused the request: {probe.error}")
    verdict: Verdict = judge(probe.body)
    return verdict


async def determinism(pinned: PinnedClient, model: str, runs: int) -> dict[str, Any]:
    answers: list[str] = []
    errors: list[str] = []
    for _ in range(runs):
        probe = await pinned.chat(
            {
                "model": model,
                "messages": [{"role": "user", "content": DETERMINISM_PROMPT}],
                "max_tokens": 32,
                "temperature": 0,
            }
        )
        if probe.status != 200:
            errors.append(probe.error)
            continue
        message = (probe.body.get("choices") or [{}])[0].get("message") or {}
        answers.append(str(message.get("content") or ""))
    distinct = len(set(answers))
    return {
        "runs": runs,
        "answered": len(answers),
        "distinct": distinct,
        "identical": bool(answers) and distinct == 1 and not errors,
        "first_error": errors[0] if errors else "",
    }


def lifecycle(provider: Row) -> dict[str, dict[str, Any]]:
    """Each flag the node claims, against what the node observed: ``list_models`` by what
    its probe listed; the others cannot be observed through the pool."""
    flags = provider.get("lifecycle_capabilities") or {}
    engine = provider.get("engine") or {}
    out: dict[str, dict[str, Any]] = {}
    for flag, claimed in flags.items():
        if flag != "list_models":
            out[flag] = {
                "claimed": claimed,
                "checked": "not checked",
                "reason": "no model lifecycle operation goes through the pool",
            }
            continue
        if not engine:
            out[flag] = {
                "claimed": claimed,
                "checked": "not checked",
                "reason": "the node does not say what its probe listed (an older node)",
            }
            continue
        listed = int(engine.get("listed_models") or 0)
        passed = (listed > 0) == bool(claimed)
        reason = f"its probe listed {listed} model(s)"
        out[flag] = {"claimed": claimed, "checked": "pass" if passed else "fail", "reason": reason}
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    perf = report["performance"]
    first = perf[0] if perf else {}
    lifecycle_checks = [v["checked"] for v in report["lifecycle"].values()]
    return {
        "ttft_p50_ms": first.get("ttft_p50_ms"),
        "tokens_per_s_single": first.get("tokens_per_s_single"),
        "tokens_per_s_aggregate_best": max(
            (row["tokens_per_s_aggregate"] or 0 for row in perf), default=None
        ),
        "failed_requests": sum(row["failed"] for row in perf),
        "context_reached_tokens": report["context"]["reached_tokens"],
        "tool_call": "pass" if report["tool_call"]["passed"] else "fail",
        "json_schema": "pass" if report["json_schema"]["passed"] else "fail",
        "deterministic": report["determinism"]["identical"],
        "lifecycle": "fail" if "fail" in lifecycle_checks else "pass",
    }


async def qualify_provider(
    client: EdgeClient,
    model: Row,
    provider: Row,
    declared: int,
    options: SuiteOptions,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The report of one provider of ``model`` (the catalog's rows of both)."""
    pin = f"{provider['node_id']}/{provider['provider_id']}"
    pinned = PinnedClient(client, pin, options)
    model_id = model["id"]
    started_ms = time.time_ns() // 1_000_000
    clock = time.monotonic()
    say(f"qualifying {model_id} on {pin}")
    report: dict[str, Any] = {
        "kind": KIND,
        "model": model_id,
        "provider_id": provider["provider_id"],
        "node_id": provider["node_id"],
        "provider_type": provider["type"],
        "served_as": model["providers"].get(provider["provider_id"], model_id),
        "engine": provider.get("engine") or {},
        "options": {**asdict(options), "levels": list(options.levels)},
        "started_ms": started_ms,
    }
    report["performance"] = await performance(pinned, model_id, options, say)
    say("  context length")
    report["context"] = await context_reached(pinned, model_id, declared, options)
    say("  tool call, JSON schema, determinism")
    report["tool_call"] = (
        await checked(pinned, tool_call_body(model_id), judge_tool_call)
    ).as_dict()
    report["json_schema"] = (
        await checked(pinned, json_schema_body(model_id), judge_json_schema)
    ).as_dict()
    report["determinism"] = await determinism(pinned, model_id, options.determinism_runs)
    report["lifecycle"] = lifecycle(provider)
    report["duration_s"] = round(time.monotonic() - clock, 1)
    report["summary"] = summary(report)
    return report


def pick_providers(model: Row, providers: Sequence[Row], wanted: Sequence[str]) -> list[Row]:
    """The model's providers in its order, only those named in ``wanted`` (``PROVIDER``
    or ``NODE/PROVIDER``) when any is; a name that is not one of them is a ``CtlError``."""
    by_id = {p["provider_id"]: p for p in providers}
    mine = [by_id[p] for p in model["providers"] if p in by_id]
    if not wanted:
        return mine
    chosen = []
    for name in wanted:
        node, _, provider_id = name.rpartition("/")
        match = [p for p in mine if p["provider_id"] == provider_id and node in ("", p["node_id"])]
        if not match:
            raise CtlError(f"{name} is not a provider of {model['id']}")
        chosen += match
    return chosen
