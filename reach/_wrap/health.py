"""The wrapped service's health, turned into the agent's status: a failing probe makes the
agent DEGRADED (high priority goes elsewhere), ``pause_after`` failures in a row make it
PAUSED (out of the queue groups), and the first success undoes both."""

from __future__ import annotations

import asyncio
import logging

import httpx

from .._agent import Agent
from .spec import HealthCheck

__all__ = ["HealthMonitor"]

log = logging.getLogger("reach.wrap")


class HealthMonitor:
    """Probes ``check.url`` and reports to ``agent``. ``check_once`` is one round; ``run``
    is the loop the wrapper owns. Its pause is its own: an operator's pause outlives the
    recovery, and an operator's resume does not end a health pause."""

    def __init__(self, agent: Agent, http: httpx.AsyncClient, check: HealthCheck) -> None:
        self.agent = agent
        self.check = check
        self._http = http
        #: failed probes in a row (0 while healthy)
        self.failures = 0
        self.probes = 0
        #: why the last probe failed ("" when it passed)
        self.last_error = ""

    async def probe(self) -> str:
        """One GET of the health URL: "" when healthy, else why not."""
        try:
            async with asyncio.timeout(self.check.timeout):
                response = await self._http.get(self.check.url, timeout=self.check.timeout)
        except (TimeoutError, httpx.TimeoutException):
            return f"no answer within {self.check.timeout:g}s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            return ""
        return f"HTTP {response.status_code}"

    async def check_once(self) -> bool:
        """Probe once and bring the agent's status in line; True when healthy."""
        return await self.record(await self.probe())

    async def record(self, why: str) -> bool:
        """Report one probe's outcome (``why`` it failed, "" if it passed) to the agent.
        The pause is the health check's own (an operator's pause or resume is another),
        so a resume that fails is simply tried again at the next healthy probe."""
        self.probes += 1
        agent = self.agent
        if not why:
            if self.failures:
                log.info(
                    "wrap %s: health is back after %d failure(s)", agent.agent_id, self.failures
                )
            self.failures, self.last_error = 0, ""
            await agent.report_health(True)
            return True
        self.failures += 1
        self.last_error = why
        pause_after = self.check.pause_after
        pause = bool(pause_after) and self.failures >= pause_after
        if await agent.report_health(False, pause=pause):
            log.warning(
                "wrap %s: %d health check(s) failed in a row (%s): %s",
                agent.agent_id,
                self.failures,
                why,
                agent.state,
            )
        return False

    async def run(self) -> None:
        """Probe every ``interval`` seconds, until cancelled (the wrapper probes once
        itself before the agent starts)."""
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(self.check.interval)
            await self.check_once()
            # On Python 3.11, asyncio.wait_for (in nats-py's flush, which pause and resume
            # await) can swallow a cancellation that lands as its PONG arrives: stop anyway.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
