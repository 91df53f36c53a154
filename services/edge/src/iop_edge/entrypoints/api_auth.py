"""API keys at the HTTP boundary: who is calling, and how many requests each key holds.

The edge never sees a key's value beyond this lookup (the ``KeyRing`` compares
hashes). Concurrency is counted here, per ``key_id``, because it is a property
of the client, not of a model's queue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aiohttp import web

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.errors import AuthenticationFailed, TooManyConcurrent
from iop_edge.ports import KeyRing


def authenticate(request: web.BaseRequest, keys: KeyRing) -> ApiKeyEntry | None:
    """The caller's key policy; ``None`` when the API is open (no keys configured).

    Raises ``AuthenticationFailed`` (401) for a missing, malformed or unknown key.
    """
    if keys.open:
        return None
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it in the Authorization header "
            "as 'Authorization: Bearer <key>'."
        )
    entry = keys.lookup(token)
    if entry is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return entry


class KeySlots:
    """Requests in progress per API key, against each key's ``max_concurrent``.

    Acquire and release never await, so the count is exact on one event loop.
    """

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)

    @contextlib.contextmanager
    def hold(self, key: ApiKeyEntry | None) -> Iterator[None]:
        """One slot of ``key`` for the block; ``TooManyConcurrent`` (429) when none is left."""
        if key is None or key.max_concurrent <= 0:
            yield
            return
        held = self._held.get(key.key_id, 0)
        if held >= key.max_concurrent:
            raise TooManyConcurrent(
                f"Too many concurrent requests for this API key "
                f"(limit {key.max_concurrent}); retry when one has finished."
            )
        self._held[key.key_id] = held + 1
        try:
            yield
        finally:
            remaining = self._held[key.key_id] - 1
            if remaining:
                self._held[key.key_id] = remaining
            else:
                del self._held[key.key_id]
