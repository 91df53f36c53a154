"""Limits per key at admission: a request of a limited key takes its rates and budget
before it takes a place in a model's queue, and counts its tokens until it ends
(docs/ARCHITECTURE.md#limits-per-key).

``KeyRates.admit`` is asked only for a key that has a limit (``limited``), so a key
without one costs one attribute read. It estimates the prompt's tokens from its text
(``estimate_input_tokens``: 4 characters a token, the usual rule for English and
code), asks the ``KeyRateStore``, holds the key's per-model concurrency, and returns the
request's ``Meter``: the deltas of a stream are counted on it as they go out, and its
``settle`` corrects the estimate with the usage the engine reported, once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from iop_edge.domain.fleet import NO_LIMITS, ApiKeyEntry, KeyLimits
from iop_edge.domain.key_rates import BUDGET, REQUESTS, Gauge, Refusal, Scopes, scopes_of
from iop_edge.errors import EdgeError, QuotaExceeded, RateLimited, TooManyConcurrent
from iop_edge.ports import KeyConcurrency, KeyRateStore, KeySlot

CHARS_PER_TOKEN: Final = 4
COUNT_EVERY: Final = 16
"""Streamed deltas counted on the meter before they are charged to the store: the store
sees a stream's output within this many tokens."""
_PROMPT_FIELDS: Final = ("messages", "prompt", "input", "system", "instructions", "tools")


def estimate_input_tokens(body: Mapping[str, Any]) -> int:
    """The prompt's tokens, estimated from the characters of its text fields."""
    chars = 0
    stack: list[Any] = [body.get(field) for field in _PROMPT_FIELDS]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def limited(key: ApiKeyEntry) -> bool:
    """Whether ``key`` may have anything ``KeyRates`` holds it to: a key without limits
    carries the one ``NO_LIMITS`` (``fleet_proto``), so asking costs two reads."""
    return key.limits is not NO_LIMITS or bool(key.model_limits)


class KeyRates:
    """Admits a limited key's requests against its store; per-model concurrency is held
    in ``shared`` (the key slots every edge shares) when there is one, else here."""

    def __init__(self, store: KeyRateStore, shared: KeyConcurrency | None = None) -> None:
        self._store = store
        self._shared = shared
        self._held: dict[str, int] = {}  # "key/model" -> requests in progress (no shared)

    async def admit(self, key: ApiKeyEntry, model: str, body: Mapping[str, Any]) -> Meter:
        """The request's meter, with the standing its answer shows (``gauges``). When a
        rate or the budget refuses it, nothing is taken and ``meter.refused`` is the error
        to answer (``RateLimited``, ``QuotaExceeded``: 429, its headers still shown);
        ``TooManyConcurrent`` is raised when its model's concurrency is used up."""
        scopes = scopes_of(key.limits, key.model_limits, model)
        per_model = key.model_limits.get(model)
        concurrency = per_model.max_concurrent if per_model is not None else 0
        slot: KeySlot | None = None
        name = f"{key.key_id}/{model}"
        if concurrency:
            slot = await self._hold(name, concurrency)
        try:
            estimate = estimate_input_tokens(body) if scopes else 0
            if scopes:
                found, refusal = await self._store.admit(key.key_id, scopes, estimate)
            else:
                found, refusal = (), None
        except BaseException:
            await self._release(name, slot, concurrency)
            raise
        counted = scopes if refusal is None else ()  # a refused request counts nothing
        meter = Meter(self, key.key_id, counted, estimate, found, (name, slot, concurrency))
        if refusal is not None:
            await meter.close()
            meter.refused = _refused(refusal, model)
        return meter

    async def _hold(self, name: str, limit: int) -> KeySlot | None:
        if self._shared is not None:
            slot = await self._shared.acquire(name, limit)
            if slot is None:
                raise _too_many(name, limit)
            return slot
        held = self._held.get(name, 0)
        if held >= limit:
            raise _too_many(name, limit)
        self._held[name] = held + 1
        return None

    async def _release(self, name: str, slot: KeySlot | None, limit: int) -> None:
        if not limit:
            return
        if slot is not None and self._shared is not None:
            await self._shared.release(slot)
            return
        left = self._held.get(name, 0) - 1
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)


class Meter:
    """One admitted request's tokens: ``output`` per streamed delta, ``settle`` with the
    engine's usage at the end (once), ``close`` to give back what it holds (once)."""

    __slots__ = (
        "_counted",
        "_estimate",
        "_hold",
        "_key",
        "_owner",
        "_scopes",
        "_streamed",
        "gauges",
        "refused",
    )

    def __init__(
        self,
        owner: KeyRates,
        key_id: str,
        scopes: Scopes,
        estimate: int,
        found: tuple[Gauge, ...],
        hold: tuple[str, KeySlot | None, int] | None,
    ) -> None:
        self._owner = owner
        self._key = key_id
        self._scopes = scopes
        self._estimate = estimate
        self._streamed = 0  # deltas counted
        self._counted = 0  # of them, charged to the store
        self._hold = hold
        self.gauges = found  # the standing after admission: the answer's headers
        self.refused: EdgeError | None = None  # a limit refused it (nothing was taken)

    def output(self) -> None:
        """One streamed delta (a token, near enough; ``settle`` corrects it)."""
        self._streamed += 1
        if self._scopes and self._streamed - self._counted >= COUNT_EVERY:
            self._owner._store.charge(self._key, self._scopes, 0, self._streamed - self._counted)
            self._counted = self._streamed

    def settle(self, prompt_tokens: int, completion_tokens: int, ran: bool) -> None:
        """The request ended: charge what it used beyond what was taken. ``ran``: it
        reached a provider (a request that never ran gives its input estimate back);
        without usage from the engine, the streamed deltas stand for its output."""
        if not self._scopes:
            return
        scopes, self._scopes = self._scopes, ()  # once
        output = completion_tokens or self._streamed
        input_used = (prompt_tokens or self._estimate) if ran else 0
        more_input = input_used - self._estimate
        more_output = output - self._counted
        if more_input or more_output:
            self._owner._store.charge(self._key, scopes, more_input, more_output)

    async def close(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            await self._owner._release(*hold)


def _too_many(name: str, limit: int) -> TooManyConcurrent:
    model = name.partition("/")[2]
    return TooManyConcurrent(
        f"Too many concurrent requests for this API key on the model '{model}' "
        f"(limit {limit}); retry when one has finished."
    )


def _refused(refusal: Refusal, model: str) -> RateLimited | QuotaExceeded:
    where = f" on the model '{model}'" if refusal.scope else ""
    wait = max(1, math.ceil(refusal.retry_after_s))
    if refusal.kind == BUDGET:
        return QuotaExceeded(
            f"You exceeded this API key's token budget{where} ({refusal.limit} tokens per "
            f"period); it renews in {wait} s.",
            retry_after_s=wait,
        )
    what = "requests per minute (RPM)" if refusal.kind == REQUESTS else _tokens(refusal.kind)
    return RateLimited(
        f"Rate limit reached for this API key{where} on {what}: limit {refusal.limit}. "
        f"Please try again in {refusal.retry_after_s:.3g}s.",
        kind="requests" if refusal.kind == REQUESTS else "tokens",
        retry_after_s=wait,
    )


def _tokens(kind: str) -> str:
    return f"{kind.replace('_', ' ')} per minute"


class LineBudget:
    """Batch lines against their owner's token budget (docs/ARCHITECTURE.md#limits-per-key).

    A line counts its tokens in its owner's budget, as the same request over HTTP would,
    and a line whose owner's budget is used up fails (429 ``insufficient_quota``, in the
    batch's error file). It is not held to the key's rates per minute nor to its models'
    concurrency: lines are backfill, paced by the pool and the batch share, and a
    nightly batch must not be refused for going as fast as idle capacity lets it.
    """

    def __init__(self, rates: KeyRates, key_of: Callable[[str], ApiKeyEntry | None]) -> None:
        """``key_of``: the fleet's key of an owner's ``key_id`` (``None``: gone or none)."""
        self._rates = rates
        self._key_of = key_of

    async def admit(self, owner: str | None, model: str, body: Mapping[str, Any]) -> Meter | None:
        """The line's meter (``None`` when its owner has no budget);
        ``QuotaExceeded`` when the budget is used up."""
        key = self._key_of(owner) if owner else None
        if key is None:
            return None
        budgeted = _budget_only(key)
        if budgeted is None:
            return None
        meter = await self._rates.admit(budgeted, model, body)
        if meter.refused is not None:
            raise meter.refused
        return meter


def _budget_only(key: ApiKeyEntry) -> ApiKeyEntry | None:
    """``key`` with its budgets only (on the key and per model); ``None`` without one."""

    def budget(limits: KeyLimits) -> KeyLimits:
        return KeyLimits(token_budget=limits.token_budget, budget_period=limits.budget_period)

    per_model = {m: budget(v) for m, v in key.model_limits.items() if v.token_budget}
    if not key.limits.token_budget and not per_model:
        return None
    return dataclasses.replace(key, limits=budget(key.limits), model_limits=per_model)
