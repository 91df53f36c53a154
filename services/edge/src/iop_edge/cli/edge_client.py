"""``iopctl``'s client of the edge's HTTP API and its table printer, shared by its commands
(``iopctl``, ``qualify_cmd``).

Every HTTP or connection failure becomes a ``CtlError``: one line on stderr, exit status 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

Row = dict[str, Any]


class CtlError(Exception):
    """An expected failure, shown as one line on stderr (exit status 1)."""


class KeyRejected(CtlError):
    """401: retrying cannot help, so even the live commands stop."""


class EdgeClient:
    """GETs one endpoint's ``data``; every HTTP or connection failure becomes a ``CtlError``."""

    def __init__(self, session: aiohttp.ClientSession, url: str, key: str) -> None:
        self._session = session
        self.url = url
        self._headers = {"Accept": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    @property
    def headers(self) -> dict[str, str]:
        """The key's headers, for a command that sends requests of its own."""
        return dict(self._headers)

    async def data(self, path: str, **query: int | str) -> list[Row]:
        body = await self.send("GET", path, query=query)
        data: list[Row] = body["data"]
        return data

    async def send(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, int | str] | None = None,
        document: object = None,
        ok: int = 200,
    ) -> Any:
        """One request's JSON answer; any other status than ``ok`` is a ``CtlError``."""
        try:
            async with self._session.request(
                method,
                f"{self.url}{path}",
                params=query or {},
                json=document,
                headers=self._headers,
            ) as response:
                if response.status == 401:
                    raise KeyRejected(
                        f"API key required: {await _message(response)} "
                        "(pass --key or set IOP_API_KEY)"
                    )
                if response.status != ok:
                    raise CtlError(f"{path}: HTTP {response.status}: {await _message(response)}")
                return await response.json()
        except aiohttp.ClientError as exc:
            raise CtlError(f"cannot reach the edge at {self.url}: {exc}") from exc
        except TimeoutError as exc:
            raise CtlError(f"the edge at {self.url} did not answer in time") from exc


async def _message(response: aiohttp.ClientResponse) -> str:
    """The OpenAI error object's message, or the raw body when there is none."""
    text = await response.text()
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200] or response.reason or ""


# ---------------------------------------------------------------- tables


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart (what ``kubectl get`` does)."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )
