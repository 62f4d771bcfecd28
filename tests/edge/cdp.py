"""Driving a headless Chromium over the DevTools protocol, with no browser library: the
browser writes its debugging port to ``DevToolsActivePort`` in its profile directory, and
one websocket (``websockets``, which uvicorn[standard] brings) carries commands and events
for every page, each page being a flattened session of its own.

Debian's package is ``chromium`` (``.ci/run`` installs it); without it the tests that need
it are skipped, saying so, and fail where ``REACH_REQUIRE_TOOLS=1`` (CI): there a missing
browser must not pass for a working page.
"""

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

from websockets.asyncio.client import connect

from reach.testing import eventually

from ..tools import need

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_binary():
    """The browser: ``REACH_CHROMIUM``, else the first of ``CANDIDATES`` on PATH (the test
    is skipped without one, or fails where ``REACH_REQUIRE_TOOLS=1``)."""
    named = os.environ.get("REACH_CHROMIUM")
    return need([named] if named else CANDIDATES, "apt-get install chromium")


class CdpError(RuntimeError):
    pass


class Chromium:
    """One headless browser; ``async with Chromium() as browser: page = await
    browser.page()``."""

    def __init__(self, *, width=1280, height=900):
        self.width, self.height = width, height
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._listeners: list[tuple[str | None, str, asyncio.Future]] = []
        self.events: dict[str | None, list[dict]] = {}

    async def __aenter__(self):
        binary = chromium_binary()
        self._dir = tempfile.mkdtemp(prefix="reach-chromium-")
        self._log = open(Path(self._dir) / "chromium.log", "wb")  # noqa: SIM115, ASYNC230
        args = [
            binary,
            "--headless=new",
            "--remote-debugging-port=0",
            f"--user-data-dir={self._dir}/profile",
            f"--window-size={self.width},{self.height}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--hide-scrollbars",
            "--mute-audio",
        ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self._proc = await asyncio.create_subprocess_exec(
            *args, "about:blank", stdout=asyncio.subprocess.DEVNULL, stderr=self._log
        )
        try:
            port_file = Path(self._dir) / "profile" / "DevToolsActivePort"

            def ready():
                if self._proc.returncode is not None:
                    raise RuntimeError(f"chromium exited ({self._proc.returncode}): {self.log()}")
                return port_file.exists() and len(port_file.read_text().splitlines()) >= 2

            await eventually(ready, timeout=30)
            port, path = port_file.read_text().splitlines()[:2]
            self._ws = await connect(f"ws://127.0.0.1:{port}{path}", max_size=None)
            self._reader = asyncio.create_task(self._read(), name="cdp-reader")
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc):
        await self._stop()

    def log(self):
        self._log.flush()
        return (Path(self._dir) / "chromium.log").read_text(errors="replace")[-2000:]

    async def _stop(self):
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        ws = getattr(self, "_ws", None)
        if ws is not None:
            await ws.close()
        if self._proc.returncode is None:
            self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _read(self):
        try:
            async for raw in self._ws:
                msg = json.loads(raw)
                if "id" in msg:
                    fut = self._calls.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        if "error" in msg:
                            fut.set_exception(CdpError(f"{msg['error']}"))
                        else:
                            fut.set_result(msg.get("result", {}))
                    continue
                session, method = msg.get("sessionId"), msg.get("method", "")
                self.events.setdefault(session, []).append(msg)
                for listener in list(self._listeners):
                    if listener[:2] == (session, method) and not listener[2].done():
                        listener[2].set_result(msg.get("params", {}))
        finally:  # the browser went: nobody waits forever
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(CdpError("the browser connection closed"))

    async def send(self, method, params=None, *, session=None, timeout=30):
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        msg = {"id": call_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        await self._ws.send(json.dumps(msg))
        return await asyncio.wait_for(fut, timeout)

    def expect(self, method, *, session=None):
        """A future for the next event ``method`` of ``session`` (made before the command
        that causes it, so it cannot be missed)."""
        fut = asyncio.get_running_loop().create_future()
        self._listeners.append((session, method, fut))
        fut.add_done_callback(lambda f: self._listeners.remove((session, method, f)))
        return fut

    async def page(self):
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page


class Page:
    def __init__(self, browser, session):
        self.browser, self.session = browser, session

    async def send(self, method, params=None, **kw):
        return await self.browser.send(method, params, session=self.session, **kw)

    def _events(self, method):
        events = self.browser.events.get(self.session, [])
        return [e["params"] for e in events if e.get("method") == method]

    @property
    def exceptions(self):
        """Uncaught JavaScript exceptions so far, as text."""
        return [
            e["exceptionDetails"].get("exception", {}).get("description")
            or e["exceptionDetails"].get("text", "")
            for e in self._events("Runtime.exceptionThrown")
        ]

    @property
    def navigations(self):
        """Main-frame documents loaded so far (a reload would add one)."""
        return sum(1 for e in self._events("Page.frameNavigated") if not e["frame"].get("parentId"))

    async def goto(self, url, timeout=30):
        loaded = self.browser.expect("Page.loadEventFired", session=self.session)
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"navigation to {url} failed: {result['errorText']}")
        await asyncio.wait_for(loaded, timeout)

    async def evaluate(self, expression):
        got = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in got:
            raise CdpError(f"{expression!r} raised: {got['exceptionDetails']}")
        return got["result"].get("value")

    async def wait_for(self, expression, until=bool, timeout=20):
        """Poll ``expression`` in the page until ``until(value)`` holds; the value."""
        seen = []

        async def holds():
            seen[:] = [await self.evaluate(expression)]
            return until(seen[0])

        try:
            await eventually(holds, timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"page never satisfied {expression!r} (last: {seen})") from None
        return seen[0]

    async def screenshot(self, path):
        """The whole page (not only the viewport) as a PNG at ``path``."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.send(
            "Page.captureScreenshot",
            {"format": "png", "clip": clip, "captureBeyondViewport": True},
        )
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(base64.b64decode(shot["data"]))  # noqa: ASYNC240
