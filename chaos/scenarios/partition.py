"""9. A network partition of one of two agents, made by a loopback TCP proxy between it and
the server (``chaos/proxy.py``) that stops forwarding and closes nothing, under request
load. Unlike SIGKILL, no "no responders" comes back: a request sent to the partitioned
agent vanishes, and only its attempt's timeout moves it on.

Goals: requests fail over within their deadline (0 failed, none past its deadline); the
partitioned agent goes UNKNOWN or DOWN, and comes back UP once the proxy resumes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import reach
from reach.testing import NatsServer

from ..harness import AgentProc, Ledger, Result, settings_for
from ..proxy import Proxy
from ..tools_b import RequestLoad, TableWatch, all_up, within

CUT = "echo-1"  # the agent behind the proxy


async def status_of(client: reach.Client, agent_id: str) -> reach.Status | None:
    records = {r.info.agent_id: r.status for r in await client.agents()}
    return records.get(agent_id)


async def run(work: Path, short: bool) -> Result:
    result = Result("partition")
    ledger = Ledger()
    runs = work / "runs"
    phase = 1.5 if short else 6.0
    async with NatsServer() as server, Proxy(server.url) as proxy:
        settings = settings_for(server.url, "chaos")
        behind = settings.model_copy(update={"nats_url": proxy.url})
        agents = [AgentProc(settings, "echo-0", runs), AgentProc(behind, CUT, runs)]
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            try:
                for a in agents:
                    await a.start()
                await all_up(client, agents)
                result.check("the agent behind the proxy uses it", proxy.connections > 0)
                table = await TableWatch(client).start()
                rload = RequestLoad(client, "chaos.echo", ledger).start()
                try:
                    await asyncio.sleep(phase)  # steady state: both agents answer
                    before = rload.by[CUT]
                    proxy.pause()
                    cut = time.monotonic()

                    async def unseen() -> bool:
                        return await status_of(client, CUT) is not reach.Status.UP

                    noticed = await within(unseen, 60)
                    result.check(
                        "the partitioned agent goes UNKNOWN or DOWN",
                        noticed is not None,
                        f"{noticed:.1f} s after the cut; it had answered {before} requests"
                        if noticed is not None
                        else "still UP 60 s after the cut",
                    )

                    async def down() -> bool:
                        return await status_of(client, CUT) in (reach.Status.DOWN, None)

                    gone = await within(down, 60) is not None
                    result.check(
                        "... then DOWN (or removed)", gone, f"{time.monotonic() - cut:.1f} s"
                    )
                    await asyncio.sleep(phase)  # the load goes on with one agent cut off
                    proxy.resume()
                    healed, healed_ms = time.monotonic(), int(time.time() * 1000)
                    slowest = rload.slowest_between(cut, healed)

                    async def back() -> bool:
                        return any(
                            r.info.agent_id == CUT
                            and r.status is reach.Status.UP
                            and r.last_seen_ms >= healed_ms
                            for r in await client.agents()
                        )

                    returned = await within(back, 60)
                    result.check(
                        "after resume() it comes back UP",
                        returned is not None,
                        f"{returned:.1f} s after" if returned is not None else "not within 60 s",
                    )
                    answered = rload.by[CUT]

                    async def serving() -> bool:
                        return rload.by[CUT] > answered

                    result.check(
                        "... and answers requests again", await within(serving, 60) is not None
                    )
                    await asyncio.sleep(phase)
                finally:
                    await rload.stop()
                    await table.stop()
                result.notes.append("in the table: " + table.summary([CUT]))
            finally:
                for a in agents:
                    await a.stop()
    ledger.into(result)
    result.check(
        "requests fail over within their deadline: no failed request",
        result.failed == 0,
        f"slowest answer in the partition {slowest * 1000:.0f} ms; {rload.notes()}",
    )
    result.check("no request runs past its deadline", rload.overdue == 0)
    result.notes.append("answers by agent: " + ", ".join(f"{k} {v}" for k, v in rload.by.items()))
    return result
