"""API keys at the HTTP boundary: who is calling, and what each key has in progress.

The edge never sees a key's value beyond this lookup (the ``KeyRing`` compares
hashes). Requests in progress are tracked here, per ``key_id``, because they are
a property of the client, not of a model's queue: each key's count is held
against its ``max_concurrent``, and a key that leaves the fleet (revoked) has
every request it still holds ended at once.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from datetime import UTC, datetime
from typing import Final

from loguru import logger

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.errors import (
    AuthenticationFailed,
    ControlPlaneUnavailable,
    KeyExpired,
    KeyRevoked,
    LoopbackOnly,
    TooManyConcurrent,
)
from iop_edge.ports import KeyConcurrency, KeyRing, KeySlot, RunEvents

KEY_REVOKED: Final = "The API key of this request was revoked; the request was ended."
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
"""Probes carry no data: load balancers reach them from anywhere, keys or not."""
NO_FLEET_YET: Final = (
    "This edge has no fleet config yet (the control-plane has not answered, and it has no "
    "cached copy): it serves nothing until one arrives; retry shortly."
)


def authenticate(request: ApiRequest, keys: KeyRing) -> ApiKeyEntry | None:
    """The caller's key policy; ``None`` when the API is open (no keys configured).

    The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or as
    ``x-api-key: <key>`` (Anthropic's); either way it is the same key, with the
    same allow-list. Raises ``AuthenticationFailed`` (401) for a missing,
    malformed (not ASCII: bytes that are not UTF-8, say) or unknown key, and
    ``ControlPlaneUnavailable`` (503) before the edge has a fleet config.
    """
    if keys.open:
        return None
    if not keys.configured:
        raise ControlPlaneUnavailable(NO_FLEET_YET)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "").strip()
    if not token:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it in the Authorization header "
            "as 'Authorization: Bearer <key>' (or as 'x-api-key: <key>')."
        )
    if not token.isascii():
        # Keys are ASCII; aiohttp hands other header bytes on as surrogate escapes, which
        # cannot even be hashed: no key, whatever else it holds.
        raise AuthenticationFailed("Incorrect API key provided: API keys are ASCII.")
    entry = keys.lookup(token)
    if entry is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    if entry.expires_ms and entry.expired(int(time.time() * 1000)):
        # Checked here, per request, against the edge's own clock: the moment holds to the
        # millisecond whether or not the control-plane's next push has arrived.
        raise KeyExpired(
            f"This API key expired at {_utc(entry.expires_ms)}; "
            "ask for a new one (or its rotated secret)."
        )
    return entry


def _utc(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1024)
def is_loopback(remote: str | None) -> bool:
    """``remote`` (aiohttp's ``request.remote``) is 127.0.0.0/8 or ::1, also IPv4-mapped.

    Anything that is not an address (``None``, a Unix socket's empty name) is not loopback.
    Asked on every request of an open edge, from the few addresses its clients have: the
    answers for the last 1,024 are kept (bounded, whoever calls).
    """
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.partition("%")[0])  # drop an IPv6 zone
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_open_access(remote: str | None, keys: KeyRing, allow_open: bool) -> None:
    """The secure default: with no keys configured, only loopback clients are served.

    Decided per request, because keys can arrive (or all be revoked) at any time;
    with keys configured it costs one attribute read.
    """
    if keys.open and not allow_open and not is_loopback(remote):
        raise LoopbackOnly(
            "This edge has no API keys configured, so it serves only loopback clients "
            "(127.0.0.0/8, ::1) until its settings say http.allow_open: true."
        )


def access_mode(keys: KeyRing, allow_open: bool, host: str) -> str:
    """The log line saying who the API serves (at start, and when keys come or go)."""
    if not keys.configured:
        return "no fleet config yet: every request is refused (503) until the control-plane answers"
    if not keys.open:
        return "API keys configured: every request needs a Bearer key"
    if allow_open:
        return (
            f"no API keys configured and http.allow_open is true: the API on {host} "
            "is open to anyone who can reach it"
        )
    return (
        "no API keys configured: the API serves loopback clients only (127.0.0.0/8, ::1); "
        "issue a key, or set http.allow_open: true, to serve others"
    )


class KeySlots:
    """Requests in progress per API key, as their runs: counted against each key's
    ``max_concurrent``, and ended when their key leaves the fleet (``apply_keys``).

    The count is this edge's own (the runs it holds), exact on one event loop, and costs
    nothing more. With ``shared`` (the store every edge of the fleet shares,
    ``KeyConcurrency``) a key with a limit also takes a slot there, so the limit holds
    across edges; each slot taken is given back exactly once, whichever way the request
    ends.
    """

    def __init__(self, shared: KeyConcurrency | None = None) -> None:
        self._shared = shared
        self._held: dict[str, set[RunEvents]] = {}
        self._present: frozenset[str] = frozenset()
        self._revoked: set[str] = set()  # left the fleet since: refused if a request arrives

    def held(self, key_id: str) -> int:
        """Requests of ``key_id`` in progress on this edge."""
        return len(self._held.get(key_id, ()))

    def check_room(self, key: ApiKeyEntry | None) -> None:
        """``TooManyConcurrent`` (429) now when ``key`` has no slot left on this edge.

        Called before a request's body is read: a key flooding the edge is refused for the
        cost of its headers, not of parsing what it sent. ``hold`` decides again (a slot
        may be taken meanwhile, here or on another edge); this only answers early what it
        would answer later.
        """
        if key is not None and 0 < key.max_concurrent <= self.held(key.key_id):
            raise _too_many(key)

    def hold(self, key: ApiKeyEntry | None, run: RunEvents) -> KeyHold:
        """One slot of ``key`` for ``run`` during the ``async with`` block;
        ``TooManyConcurrent`` (429) when none is left. A revocation meanwhile ends the run
        (``KeyRevoked``, 401, or an error event once its stream started): nothing else is
        cancelled."""
        return KeyHold(self, key, run)

    def _enter(self, key: ApiKeyEntry) -> KeyConcurrency | None:
        """Admit ``key`` on this edge; the shared store when it must be asked too."""
        if key.key_id in self._revoked:
            # authenticated a moment before the revocation arrived (its body was still coming)
            raise KeyRevoked(KEY_REVOKED)
        self.check_room(key)
        return self._shared if key.max_concurrent > 0 else None

    async def _take(self, shared: KeyConcurrency, key: ApiKeyEntry) -> KeySlot:
        slot = await shared.acquire(key.key_id, key.max_concurrent)
        if slot is None:
            raise _too_many(key)  # held on other edges
        if key.key_id in self._revoked:  # revoked while the slot was being taken
            await shared.release(slot)
            raise KeyRevoked(KEY_REVOKED)
        return slot

    def _add(self, key_id: str, run: RunEvents) -> None:
        self._held.setdefault(key_id, set()).add(run)

    def _remove(self, key_id: str, run: RunEvents) -> None:
        runs = self._held.get(key_id)
        if runs is not None:
            runs.discard(run)
            if not runs:
                del self._held[key_id]

    async def apply_keys(self, present: frozenset[str]) -> int:
        """The fleet's keys are now ``present``: end every request of a key that is not.

        Returns how many requests were ended (each logged once, in one line per key).
        """
        self._revoked = (self._revoked | (self._present - present)) - present
        self._present = present
        ended = 0
        for key_id in [k for k in self._held if k not in present]:
            self._revoked.add(key_id)
            runs = list(self._held[key_id])
            for run in runs:
                await run.cancel("API key revoked", KeyRevoked(KEY_REVOKED))
            ended += len(runs)
            logger.warning("API key {} revoked: ended its {} request(s)", key_id, len(runs))
        return ended


def _too_many(key: ApiKeyEntry) -> TooManyConcurrent:
    return TooManyConcurrent(
        f"Too many concurrent requests for this API key "
        f"(limit {key.max_concurrent}); retry when one has finished."
    )


class KeyHold:
    """``KeySlots.hold``: the slot is taken on entry and given back on exit, once, on
    every way out of the block. A plain class on every keyed request's path: without a
    shared store nothing in it awaits."""

    __slots__ = ("_key", "_owner", "_run", "_slot")

    def __init__(self, owner: KeySlots, key: ApiKeyEntry | None, run: RunEvents) -> None:
        self._owner, self._key, self._run = owner, key, run
        self._slot: KeySlot | None = None

    async def __aenter__(self) -> None:
        key = self._key
        if key is None:
            return
        owner = self._owner
        shared = owner._enter(key)
        if shared is not None:
            self._slot = await owner._take(shared, key)
        owner._add(key.key_id, self._run)

    async def __aexit__(self, *exc_info: object) -> None:
        key = self._key
        if key is None:
            return
        owner = self._owner
        owner._remove(key.key_id, self._run)
        slot, self._slot = self._slot, None
        if slot is not None and owner._shared is not None:
            await owner._shared.release(slot)
