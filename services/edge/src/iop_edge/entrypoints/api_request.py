"""What the API's request pipeline reads of a request: the port both HTTP fronts serve.

The inference routes, the gate and the error boundary read a request through this
and nothing else, so one request is served the same way whether aiohttp's server
parsed it (``web.Request`` has all of it) or the edge's own front for the inference
routes did (``fast_front``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol


class BodyProgress(Protocol):
    """How much of a body has arrived (aiohttp's ``request.content`` has it)."""

    @property
    def total_bytes(self) -> int: ...

    def is_eof(self) -> bool: ...


class ApiRequest(Protocol):
    """One HTTP request as the API reads it."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def remote(self) -> str | None: ...

    @property
    def body_exists(self) -> bool: ...

    @property
    def content(self) -> BodyProgress: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    async def read(self) -> bytes:
        """The whole body (``web.HTTPRequestEntityTooLarge`` past the body limit)."""
        ...
