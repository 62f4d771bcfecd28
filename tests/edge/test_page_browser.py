"""The status page in a real browser (headless Chromium over the DevTools protocol): the
agents appear, then traffic, a dead letter and a status change, all in the same page
load, pushed by the server. The last view is saved to a temporary file, or, to refresh
the README's picture, to ``REACH_SCREENSHOT`` (``bench/results/status-page.png``)."""

import os
from pathlib import Path

import pytest
from fastapi import Depends, Header, HTTPException

from .cdp import Chromium, chromium_binary
from .fleet import ECHO, TASK, fleet
from .server import serve

DASH = "\u2013"  # the page's "no value"

AGENTS = """Object.fromEntries([...document.querySelectorAll('#agents tr[data-agent]')]
  .map(r => [r.dataset.agent, r.querySelector('.badge').dataset.status]))"""


@pytest.fixture(autouse=True)
def _browser():
    chromium_binary()  # skipped (or failed, REACH_REQUIRE_TOOLS=1) before a fleet starts


def cell(capability, column):
    return f"""document.querySelector('#caps tr[data-capability="{capability}"]')
      ?.cells[{column}].textContent ?? null"""


async def test_page_shows_the_fleet_and_follows_changes_without_reload(reach_settings, tmp_path):
    shot = Path(os.environ.get("REACH_SCREENSHOT") or tmp_path / "status-page.png")
    async with (
        fleet(reach_settings, interval=1.0) as f,
        serve(f.app(), on_exit=f.feed.shutdown) as url,
        Chromium(width=1280, height=900) as browser,
    ):
        page = await browser.page()
        await page.goto(url + "/")
        await page.evaluate("window.loadMark = 'first load'")

        want = {"builder-1": "UP", "echo-1": "UP", "echo-2": "UP"}
        assert await page.wait_for(AGENTS, until=want.__eq__) == want
        assert await page.wait_for(cell(ECHO, 2)) == "2"  # two instances UP
        assert await page.evaluate("document.getElementById('conn').dataset.state") == "live"

        # traffic and a dead letter, shown by the next snapshots
        await f.traffic(ok=40, failing=4)
        assert await (await f.client.submit(TASK, {"n": 1})).result(timeout=30) == {"n": 2}
        failing = await f.client.submit(TASK, {"n": 2, "fail": True}, max_attempts=1)
        await failing.wait(timeout=30)
        rate = await page.wait_for(cell(ECHO, 7), until=lambda v: v not in (DASH, "0.0", None))
        assert float(rate) > 0
        dlq_task = await page.wait_for(
            "document.querySelector('#dlq tr[data-seq] td:nth-child(4)')?.textContent"
        )
        assert dlq_task == failing.task_id

        # a status change, pushed while the page stays loaded
        await f.agents["echo-2"].pause()
        status = "document.querySelector('#agents tr[data-agent=\"echo-2\"] .badge').dataset.status"
        assert await page.wait_for(status, until="PAUSED".__eq__) == "PAUSED"
        assert await page.wait_for(cell(ECHO, 4), until="1".__eq__) == "1"

        assert await page.evaluate("window.loadMark") == "first load"
        assert page.navigations == 1
        assert page.exceptions == []
        await page.screenshot(shot)
    with shot.open("rb") as png:  # noqa: ASYNC230 (a few bytes of a local file)
        assert png.read(4) == b"\x89PNG"


def bearer(token):
    """A route guard like the gateway's: ``Authorization: Bearer <token>`` or 401."""

    async def check(authorization: str | None = Header(default=None)):
        if authorization != f"Bearer {token}":
            raise HTTPException(401, "a bearer token is required")

    return Depends(check)


async def test_behind_a_token_the_page_asks_for_it_and_sends_it_as_a_header(reach_settings):
    token = "s3cret-token-for-the-page"
    agents = "document.querySelectorAll('#agents tr[data-agent]').length"
    async with (
        fleet(reach_settings) as f,
        serve(f.app(dependencies=[bearer(token)]), on_exit=f.feed.shutdown) as url,
        Chromium() as browser,
    ):
        page = await browser.page()
        await page.goto(url + "/")  # the page itself needs no token; its data does
        await page.wait_for("!document.getElementById('login').hidden")
        assert await page.evaluate("document.getElementById('conn').textContent") == (
            "A token is needed"
        )
        await page.evaluate(
            f"document.getElementById('token').value = {token!r};"
            "document.getElementById('login').requestSubmit()"
        )
        assert await page.wait_for(agents, until=(3).__eq__) == 3
        assert await page.evaluate("document.getElementById('login').hidden") is True

        other = await browser.page()  # a new tab: nothing stored; the token in the fragment
        await other.goto(f"{url}/#token={token}")
        assert await other.wait_for(agents, until=(3).__eq__) == 3
        assert await other.evaluate("location.hash") == ""  # not left in the address bar
        assert page.exceptions == other.exceptions == []
