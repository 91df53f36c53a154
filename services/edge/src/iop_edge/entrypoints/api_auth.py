"""API keys at the HTTP boundary: who is calling, and what each key has in progress.

The edge never sees a key's value beyond this lookup (the ``KeyRing`` compares
hashes). Requests in progress are tracked here, per ``key_id``, because they are
a property of the client, not of a model's queue: each key's count is held
against its ``max_concurrent``, and a key that leaves the fleet (revoked) has
every request it still holds ended at once.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
from collections.abc import Iterator
from typing import Final

from loguru import logger

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.errors import (
    AuthenticationFailed,
    KeyRevoked,
    LoopbackOnly,
    TooManyConcurrent,
)
from iop_edge.ports import KeyRing, RunEvents

KEY_REVOKED: Final = "The API key of this request was revoked; the request was ended."
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
"""Probes carry no data: load balancers reach them from anywhere, keys or not."""


def authenticate(request: ApiRequest, keys: KeyRing) -> ApiKeyEntry | None:
    """The caller's key policy; ``None`` when the API is open (no keys configured).

    The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or as
    ``x-api-key: <key>`` (Anthropic's); either way it is the same key, with the
    same allow-list. Raises ``AuthenticationFailed`` (401) for a missing,
    malformed (not ASCII: bytes that are not UTF-8, say) or unknown key.
    """
    if keys.open:
        return None
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
    return entry


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


def access_mode(keys_open: bool, allow_open: bool, host: str) -> str:
    """The log line saying who the API serves (at start, and when keys come or go)."""
    if not keys_open:
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

    Touched twice per request (start and end), never in between; acquire and
    release never await, so the counts are exact on one event loop.
    """

    def __init__(self) -> None:
        self._held: dict[str, set[RunEvents]] = {}
        self._present: frozenset[str] = frozenset()
        self._revoked: set[str] = set()  # left the fleet since: refused if a request arrives

    def held(self, key_id: str) -> int:
        return len(self._held.get(key_id, ()))

    def check_room(self, key: ApiKeyEntry | None) -> None:
        """``TooManyConcurrent`` (429) now when ``key`` has no slot left.

        Called before a request's body is read: a key flooding the edge is refused for the
        cost of its headers, not of parsing what it sent. ``hold`` decides again (a slot
        may be taken meanwhile); this only answers early what it would answer later.
        """
        if key is not None and 0 < key.max_concurrent <= self.held(key.key_id):
            raise TooManyConcurrent(
                f"Too many concurrent requests for this API key "
                f"(limit {key.max_concurrent}); retry when one has finished."
            )

    @contextlib.contextmanager
    def hold(self, key: ApiKeyEntry | None, run: RunEvents) -> Iterator[None]:
        """One slot of ``key`` for ``run`` during the block; ``TooManyConcurrent`` (429)
        when none is left. A revocation meanwhile ends the run (``KeyRevoked``, 401, or
        an error event once its stream started): nothing else is cancelled."""
        if key is None:
            yield
            return
        if key.key_id in self._revoked:
            # authenticated a moment before the revocation arrived (its body was still coming)
            raise KeyRevoked(KEY_REVOKED)
        self.check_room(key)
        runs = self._held.setdefault(key.key_id, set())
        runs.add(run)
        try:
            yield
        finally:
            runs.discard(run)
            if not runs and self._held.get(key.key_id) is runs:
                del self._held[key.key_id]

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
