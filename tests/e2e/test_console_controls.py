"""The console's runtime control page (console/static/controls.html) in a real headless
Chromium against the real stack: drain and enable a provider by its buttons, and see the
state and the audit trail the control-plane keeps (docs/ARCHITECTURE.md#runtime-control).

Like tests/e2e/test_console.py: Debian's ``chromium`` driven by Playwright's Python
package; where Chromium is missing or cannot start, the test skips and says why.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page, Request

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_MS = 15_000
TARGET = "node-a/node-a-mock"


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def test_the_control_page_drains_and_enables_a_provider(stack: Any, page: Page) -> None:
    from playwright.async_api import expect

    edge_url = str(stack.api_url).removesuffix("/v1")
    posts: list[Request] = []
    page.on("request", lambda r: posts.append(r) if r.method == "POST" else None)
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))

    await page.goto(f"{edge_url}/iop/console")
    await page.get_by_test_id("controls-link").click()
    await page.wait_for_url("**/iop/console/static/controls.html")
    await page.get_by_test_id(f"control-drain-{TARGET}").click(timeout=WAIT_MS)
    audit = page.get_by_test_id("controls-audit")
    await expect(audit).to_contain_text(f"state {TARGET}", timeout=WAIT_MS)
    await expect(audit).to_contain_text("draining")
    await expect(page.get_by_test_id("controls-in-force")).to_contain_text(
        f"state {TARGET} = draining"
    )
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{edge_url}/iop/v1/catalog/providers") as response:
            rows = {r["provider_id"]: r for r in (await response.json())["data"]}
    assert rows["node-a-mock"]["control"]["state"] in ("draining", "drained")
    assert rows["node-a-mock"]["control"]["controls"][0]["changed_by"] == "open API"
    assert rows["node-a-mock"]["capacity"] == 0  # the JSON keeps selection's truth
    # The main page shows the capacity it serves with once enabled and the state, not 0/100%
    overview = await page.context.new_page()
    await overview.goto(f"{edge_url}/iop/console")
    row = overview.get_by_test_id("nodes").locator(
        '[data-testid="provider-row"][data-provider-id="node-a-mock"]'
    )
    await expect(row.get_by_test_id("held-state")).to_have_text(
        re.compile("^(draining|drained)$"), timeout=WAIT_MS
    )
    await expect(row.get_by_test_id("capacity")).to_have_text("2")
    await expect(row.get_by_test_id("load-bar")).to_have_count(0)
    await overview.close()

    await page.get_by_test_id(f"control-enable-{TARGET}").click()
    await expect(page.get_by_test_id("controls-in-force")).to_have_count(0, timeout=WAIT_MS)
    assert [r.url.removeprefix(edge_url) for r in posts] == ["/iop/v1/controls"] * 2
    assert page_errors == []
