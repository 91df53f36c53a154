"""The operator console in a real headless Chromium, and ``iopctl``, against the real stack.

The browser is Debian's ``chromium`` driven by Playwright's Python package (never
``playwright install``: no download at test time). Where Chromium is missing or
cannot start, the browser tests skip and say why; the ``iopctl`` tests still run.
The browser test leaves ``test-artifacts/console.png`` (git-ignored) behind, the
history's ``var/console-history.png`` (git-ignored too; its path is printed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page, Request, Route

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py (a conftest cannot be imported)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FLEET_PROVIDERS = {"node-a-mock", "node-a-solo", "node-b-mock"}
WAIT_MS = 15_000  # upper bound for the page to show a state (it polls every second)


@pytest.fixture(scope="module")
def edge_url(stack: Stack) -> str:
    return str(stack.api_url).removesuffix("/v1")


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def wait_until_available(edge_url: str, providers: set[str]) -> None:
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(20):
            while True:
                async with http.get(f"{edge_url}/iop/v1/catalog/providers") as response:
                    rows = (await response.json())["data"]
                if providers <= {r["provider_id"] for r in rows if r["health"] == "available"}:
                    return
                await asyncio.sleep(0.1)  # the state lives in other processes


def provider_row(page: Page, provider_id: str) -> Any:
    # Each provider has one row under its node (and one under each model it serves).
    return page.locator(
        f'[data-testid="node-section"] [data-testid="provider-row"]'
        f'[data-provider-id="{provider_id}"]'
    )


async def slow_stream(edge_url: str) -> str:
    """A streaming run that holds node-a-solo's one slot for 3 s; its run id."""
    body = {
        "model": "solo",
        "messages": [{"role": "user", "content": "take your time"}],
        "max_tokens": 8,
        "stream": True,
        "iop_mock": {"delay_ms": 3000},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{edge_url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.read()).rstrip().endswith(b"data: [DONE]")
            return response.headers["X-Request-Id"]


# ---------------------------------------------------------------- the page in a browser


async def test_console_shows_the_fleet_and_a_run_live(edge_url: str, page: Page) -> None:
    from playwright.async_api import expect

    await wait_until_available(edge_url, FLEET_PROVIDERS)
    requests: list[Request] = []
    page.on("request", lambda request: requests.append(request))
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))

    await page.goto(f"{edge_url}/iop/console")
    rows = page.locator('[data-testid="node-section"] [data-testid="provider-row"]')
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    assert set(await rows.evaluate_all("rs => rs.map(r => r.dataset.providerId)")) == (
        FLEET_PROVIDERS
    )
    await expect(page.locator('[data-testid="node-section"]')).to_have_count(2)
    mock_small = page.locator('[data-testid="model-section"][data-model-id="mock-small"]')
    await expect(mock_small.locator('[data-testid="provider-row"]')).to_have_count(2)
    await expect(mock_small.locator('[data-testid="model-available"]')).to_have_text("2 / 2")
    solo = provider_row(page, "node-a-solo")
    await expect(solo.locator('[data-testid="health"]')).to_have_text("available")
    await expect(solo.locator('[data-testid="capacity"]')).to_have_text("1")
    await expect(solo.locator('[data-testid="in-flight"]')).to_have_text("0")
    await expect(page.locator("button")).to_have_count(0)  # read-only: nothing to press
    # A reload would drop this marker: everything below must arrive by polling.
    await page.evaluate("window.__sameDocument = true")

    run = asyncio.create_task(slow_stream(edge_url))
    try:
        await expect(solo.locator('[data-testid="in-flight"]')).to_have_text("1", timeout=WAIT_MS)
        await expect(solo.locator('[data-testid="load-ratio"]')).to_have_text("100%")
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=ARTIFACTS / "console-in-flight.png", full_page=True)
        run_id = await asyncio.wait_for(run, 20)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)

    run_row = page.locator(f'[data-testid="run-row"][data-run-id="{run_id}"]')
    await expect(run_row).to_have_count(1, timeout=WAIT_MS)
    await expect(run_row.locator('[data-testid="run-model"]')).to_have_text("solo")
    await expect(run_row.locator('[data-testid="run-provider"]')).to_have_text("node-a-solo")
    await expect(run_row.locator('[data-testid="run-outcome"]')).to_contain_text("completed")
    await expect(solo.locator('[data-testid="in-flight"]')).to_have_text("0", timeout=WAIT_MS)
    # The usage view: the open API's runs (no key), by API, and no limit to show.
    usage = page.locator('[data-testid="usage-row"][data-key-id=""]')
    await expect(usage.locator('[data-testid="usage-by-api"]')).to_contain_text(
        "chat_completions", timeout=WAIT_MS
    )
    await expect(usage.locator('[data-testid="usage-rpm"]')).to_contain_text("/ unlimited")
    await page.screenshot(path=ARTIFACTS / "console.png", full_page=True)

    assert await page.evaluate("window.__sameDocument") is True
    assert page_errors == []
    # Read-only and offline: the page only ever GETs from the edge it came from.
    assert {r.method for r in requests} == {"GET"}
    assert {r.url.split("/iop/", 1)[0] for r in requests} == {edge_url}
    polled = {r.url.removeprefix(edge_url) for r in requests if "/iop/v1/" in r.url}
    assert polled == {
        "/iop/v1/catalog/providers",
        "/iop/v1/catalog/models",
        "/iop/v1/runs?limit=20",
        "/iop/v1/usage",
        "/iop/v1/history",
        "/iop/v1/catalog/qualifications",
    }


HISTORY_METRICS = ("requests", "tokens_per_s", "ttft_ms", "queue_depth", "errors")
STEP_S = 10  # the console's step (the history endpoint's default)
WAVES = 3
VAR = Path(__file__).resolve().parents[2] / "var"


async def traffic(edge_url: str) -> list[int]:
    """Real runs for the history: streams on both models, three at once on solo's one
    slot (two of them queue), and one the provider fails (a drill); their statuses."""

    async def chat(http: aiohttp.ClientSession, model: str, **drill: object) -> int:
        body: dict[str, object] = {
            "model": model,
            "messages": [{"role": "user", "content": "plot me"}],
            "max_tokens": 16,
            "stream": True,
        }
        if drill:
            body["iop_mock"] = drill
        async with http.post(f"{edge_url}/v1/chat/completions", json=body) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession() as http:
        return list(
            await asyncio.gather(
                *(chat(http, "solo", delay_ms=400) for _ in range(3)),
                *(chat(http, "mock-small") for _ in range(6)),
                chat(http, "mock-small", fail="provider_error"),
            )
        )


async def history_holds(edge_url: str, what: dict[str, float]) -> dict[str, Any]:
    """The history once the sum of each metric named in ``what`` (over every series and
    step) reaches its value: the runs are in the run log (the writer flushes in batches)."""
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(20):
            while True:
                async with http.get(f"{edge_url}/iop/v1/history") as response:
                    assert response.status == 200
                    history: dict[str, Any] = await response.json()
                totals = {
                    metric: sum(v or 0 for s in history["data"] for v in s[metric])
                    for metric in what
                }
                if all(totals[metric] >= least for metric, least in what.items()):
                    return history
                await asyncio.sleep(0.2)  # the run log is written by another process


COLOURED_PIXELS = """async (png) => {
  // The pixels of a screenshot that are a line's colour: neither white nor a grey.
  const image = new Image();
  image.src = `data:image/png;base64,${png}`;
  await image.decode();
  const canvas = document.createElement("canvas");
  canvas.width = image.width;
  canvas.height = image.height;
  const context = canvas.getContext("2d");
  context.drawImage(image, 0, 0);
  const { data } = context.getImageData(0, 0, image.width, image.height);
  let coloured = 0;
  for (let i = 0; i < data.length; i += 4) {
    const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
    if (Math.max(r, g, b) - Math.min(r, g, b) > 60) coloured += 1;
  }
  return coloured;
}"""


async def test_console_plots_the_history_after_real_traffic(edge_url: str, page: Page) -> None:
    """The history plots in a real browser after real runs: one plot per metric, each
    with a line of points drawn, and the screenshot's pixels show them."""
    from playwright.async_api import expect

    await wait_until_available(edge_url, FLEET_PROVIDERS)
    statuses: list[int] = []
    for wave in range(WAVES):
        if wave:  # each wave in a step of its own, so the plots show lines, not a spike
            await asyncio.sleep(STEP_S - time.time() % STEP_S + 0.1)
        statuses += await traffic(edge_url)
    assert statuses.count(200) >= 9 * WAVES, statuses
    history = await history_holds(
        edge_url,
        {"requests": 10 * WAVES, "errors": WAVES, "queue_depth": 0.001, "tokens_per_s": 1},
    )
    pairs = {(s["model"], s["provider_id"]) for s in history["data"]}
    assert ("solo", "node-a-solo") in pairs
    assert pairs & {("mock-small", "node-a-mock"), ("mock-small", "node-b-mock")}

    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    await page.goto(f"{edge_url}/iop/console")
    plots = page.locator('[data-testid="history-plot"]')
    await expect(plots).to_have_count(len(HISTORY_METRICS), timeout=WAIT_MS)
    assert await plots.evaluate_all("ps => ps.map(p => p.dataset.metric)") == list(HISTORY_METRICS)
    for metric in HISTORY_METRICS:
        plot = page.locator(f'[data-testid="history-plot"][data-metric="{metric}"]')
        # Every metric has data: its top is above zero, and a line with points is drawn.
        assert float(await plot.get_attribute("data-max") or 0) > 0, metric
        lines = plot.locator('[data-testid="history-line"]')
        assert await lines.count() >= 1, metric
        points = await lines.evaluate_all("ls => ls.map(l => Number(l.dataset.points))")
        assert sum(points) >= 1, metric
        # Drawn, not only in the DOM: the lines' box in the browser's layout is not empty.
        box = await lines.evaluate_all(
            "ls => ls.map(l => l.getBBox()).reduce((a, b) => a + b.width + b.height, 0)"
        )
        assert box > 0, metric
    solo = page.locator(
        '[data-testid="history-plot"][data-metric="requests"]'
        ' [data-testid="history-line"][data-series="solo/node-a-solo"]'
    )
    await expect(solo).to_have_count(1)
    assert "L" in (await solo.get_attribute("d") or "")  # a line across the steps

    section = page.get_by_test_id("history")
    png = await section.screenshot()
    coloured = await page.evaluate(COLOURED_PIXELS, base64.b64encode(png).decode())
    assert coloured > 200, coloured  # the lines and the legend's swatches
    VAR.mkdir(exist_ok=True)
    shot = VAR / "console-history.png"
    await page.screenshot(path=shot, full_page=True)
    print(f"console history screenshot: {shot}")
    assert page_errors == []


async def test_console_asks_for_a_key_and_sends_it_as_bearer(edge_url: str, page: Page) -> None:
    """The stack's API is open, so a route in the browser plays an edge with one key:
    the real key check is the API's own (its unit tests); this is the page's half."""
    from playwright.async_api import expect

    key = "sk-iop-console-test"
    seen: list[str] = []

    async def keyed_edge(route: Route, request: Request) -> None:
        authorization = request.headers.get("authorization", "")
        seen.append(authorization)
        if authorization == f"Bearer {key}" and "/iop/v1/history" in request.url:
            # The key is not an operator's: the edge's answer to it (history_routes).
            error = {"message": "operator keys only", "code": "operator_only"}
            await route.fulfill(status=403, json={"error": error})
        elif authorization == f"Bearer {key}":
            await route.continue_()
        else:
            error = {"message": "Incorrect API key provided.", "type": "invalid_request_error"}
            await route.fulfill(status=401, json={"error": error})

    await page.route("**/iop/v1/**", keyed_edge)
    await page.goto(f"{edge_url}/iop/console")
    banner = page.get_by_test_id("auth-status")
    await expect(banner).to_contain_text("API key required", timeout=WAIT_MS)
    await expect(page.locator('[data-testid="provider-row"]')).to_have_count(0)

    await page.get_by_test_id("api-key").fill("wrong")
    await page.get_by_test_id("api-key").press("Enter")
    await expect(banner).to_contain_text("not accepted", timeout=WAIT_MS)

    await page.get_by_test_id("api-key").fill(key)
    await page.get_by_test_id("api-key").press("Enter")
    rows = page.locator('[data-testid="node-section"] [data-testid="provider-row"]')
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    await expect(banner).to_be_hidden()
    assert f"Bearer {key}" in seen
    # The rest of the page stays for a key the history is not for.
    await expect(page.get_by_test_id("history-forbidden")).to_be_visible()

    # The key lives in this tab's sessionStorage: a reload keeps the console signed in.
    await page.reload()
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    await expect(banner).to_be_hidden()


# ---------------------------------------------------------------- what the edge serves


def qualification(provider_id: str, ttft_ms: float) -> dict[str, Any]:
    """A report as ``iopctl qualify`` posts it (only what the panel reads)."""
    return {
        "kind": "iop.qualification/v1",
        "model": "mock-small",
        "provider_id": provider_id,
        "node_id": provider_id.rsplit("-", 1)[0],
        "engine": {"name": "iop-mock", "version": "0.1.0", "device": "none (simulated)"},
        "performance": [
            {
                "concurrency": 1,
                "ttft_p50_ms": ttft_ms,
                "tokens_per_s_single": 50.0,
                "tokens_per_s_aggregate": 40.0,
                "failed": 0,
            }
        ],
        "context": {"reached_tokens": 4096},
        "tool_call": {"passed": True, "reason": ""},
        "json_schema": {"passed": False, "reason": "the answer is not JSON"},
        "determinism": {"runs": 3, "answered": 3, "distinct": 1, "identical": True},
        "summary": {
            "ttft_p50_ms": ttft_ms,
            "tool_call": "pass",
            "json_schema": "fail",
            "deterministic": True,
        },
    }


async def test_console_lists_qualification_reports_and_compares_two(
    edge_url: str, page: Page
) -> None:
    from playwright.async_api import expect

    stored = []
    async with aiohttp.ClientSession() as http:
        for provider_id, ttft in (("node-a-mock", 200.0), ("node-b-mock", 100.0)):
            url = f"{edge_url}/iop/v1/qualifications"
            async with http.post(url, json=qualification(provider_id, ttft)) as response:
                assert response.status == 201, await response.text()
                stored.append((await response.json())["id"])
    await page.goto(f"{edge_url}/iop/console")
    rows = page.locator('[data-testid="qualifications-table"] tbody tr')
    await expect(rows).to_have_count(2, timeout=WAIT_MS)
    await expect(rows.first).to_contain_text("iop-mock 0.1.0")
    for report_id in stored:  # A first, then B
        await page.locator(f'input[data-id="{report_id}"]').check()
    compared = page.get_by_test_id("qualification-compare-table")
    await expect(compared).to_contain_text("B vs A", timeout=WAIT_MS)
    await expect(compared).to_contain_text("node-b/node-b-mock")
    await expect(compared).to_contain_text("-100 (0.50x)")  # B's TTFT against A's


async def test_console_assets_are_served_from_the_package(edge_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{edge_url}/iop/console") as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            assert response.headers["Cache-Control"] == "no-cache"
            csp = response.headers["Content-Security-Policy"]
            assert "connect-src 'self'" in csp
            html = await response.text()
        assert "console/static/console.js" in html
        for name, content_type in (
            ("console.js", "text/javascript"),
            ("history.js", "text/javascript"),
            ("qualifications.js", "text/javascript"),
            ("console.css", "text/css"),
        ):
            url = f"{edge_url}/iop/console/static/{name}"
            async with http.get(url) as response:
                assert response.status == 200
                assert response.content_type == content_type
                assert response.charset == "utf-8"
                etag = response.headers["ETag"]
                text = await response.text()
            # Offline: nothing is fetched from anywhere but the edge. (SVG's namespace is
            # a name, never fetched; it is the one such string the plots may hold.)
            text = text.replace('"http://www.w3.org/2000/svg"', "")
            assert "http://" not in text
            assert "https://" not in text
            async with http.get(url, headers={"If-None-Match": etag}) as response:
                assert response.status == 304
        async with http.get(f"{edge_url}/iop/console/static/nope.js") as response:
            assert response.status == 404
        async with http.get(f"{edge_url}/iop/console/", allow_redirects=False) as response:
            assert response.status == 308
            assert response.headers["Location"] == "/iop/console"


# ---------------------------------------------------------------- iopctl


async def iopctl(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iopctl"),
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_iopctl_providers_table_and_json(edge_url: str) -> None:
    await wait_until_available(edge_url, FLEET_PROVIDERS)
    status, out, err = await iopctl("providers", "--url", edge_url)
    assert status == 0, err
    header, *lines = out.splitlines()
    assert header.split()[:4] == ["PROVIDER", "NODE", "TYPE", "HEALTH"]
    assert {line.split()[0] for line in lines} == FLEET_PROVIDERS
    solo = next(line.split() for line in lines if line.startswith("node-a-solo"))
    assert solo[1:4] == ["node-a", "mock", "available"]
    assert solo[-1] == "solo"

    status, out, err = await iopctl("providers", "--json", "--url", edge_url)
    assert status == 0, err
    rows = json.loads(out)
    assert {r["provider_id"] for r in rows} == FLEET_PROVIDERS
    assert {r["node_id"] for r in rows} == {"node-a", "node-b"}


async def test_iopctl_models_and_runs(edge_url: str) -> None:
    status, out, err = await iopctl("models", "--url", f"{edge_url}/v1")
    assert status == 0, err
    assert [line.split()[0] for line in out.splitlines()] == ["ID", "mock-small", "solo"]
    status, out, err = await iopctl("runs", "--json", "--limit", "5", "--url", edge_url)
    assert status == 0, err
    assert isinstance(json.loads(out), list)
