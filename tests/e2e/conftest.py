"""The browser the console tests drive: Debian's ``chromium`` through Playwright's Python
package (never a downloaded browser: this machine reaches no browser host), one per test
module. A machine without either skips those tests with the reason."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from playwright.async_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root in a container, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install chromium)")
    return CHROMIUM


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(chromium: Path) -> AsyncIterator[Browser]:
    async_api = pytest.importorskip(
        "playwright.async_api", reason="the playwright package is not installed"
    )
    async with async_api.async_playwright() as playwright:
        try:
            launched = await playwright.chromium.launch(
                executable_path=str(chromium), args=CHROMIUM_ARGS, timeout=60_000
            )
        except async_api.Error as exc:
            pytest.skip(f"playwright cannot launch {chromium}: {exc.message.splitlines()[0]}")
        try:
            yield launched
        finally:
            await launched.close()
