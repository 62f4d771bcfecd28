"""4. nats-server SIGKILLed and restarted on the same port and store, under request and task
load (two agent processes, an in-process registry and client).

Goals: clients and agents reconnect by themselves and the routing table recovers (every
agent is UP again on a lease written after the restart, and answers); requests succeed
again; no durable task is lost (every accepted submit ends SUCCEEDED; a submit that raised
during the outage is failed with its error, not lost); requests during the outage fail with
a clear ``ReachError`` and none runs past its deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import reach
from reach.testing import NatsServer

from ..harness import AgentProc, Ledger, Result, settings_for
from ..tools_b import RequestLoad, TaskLoad, account, all_up, examples, within


async def run(work: Path, short: bool) -> Result:
    result = Result("server_restart")
    requests, tasks = Ledger(), Ledger()
    runs = work / "runs"
    phase, outage = (1.5, 2.0) if short else (5.0, 5.0)
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        agents = [AgentProc(settings, f"echo-{i}", runs) for i in range(2)]
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            try:
                for a in agents:
                    await a.start()
                await all_up(client, agents)
                rload = RequestLoad(client, "chaos.echo", requests, timeout=2.0).start()
                tload = TaskLoad(client, "chaos.job", tasks).start()
                try:
                    await asyncio.sleep(phase)  # steady state before the fault
                    port, store = server.port, server.store_dir
                    await server.akill()
                    await asyncio.sleep(outage)  # the load runs on against no server
                    await server.astart()
                    restarted, restarted_ms = time.monotonic(), int(time.time() * 1000)
                    result.check(
                        "the server came back on the same port and store",
                        (server.port, server.store_dir) == (port, store),
                    )

                    async def leased_again() -> bool:
                        records = await client.agents("chaos.echo")
                        return sum(
                            r.status is reach.Status.UP and r.last_seen_ms >= restarted_ms
                            for r in records
                        ) >= len(agents)

                    took = await within(leased_again, 60)
                    recovered = time.monotonic()
                    result.check(
                        "clients and agents reconnect, the routing table recovers",
                        took is not None,
                        f"every agent UP on a fresh lease {recovered - restarted:.1f} s"
                        " after the restart"
                        if took is not None
                        else "not every agent UP on a fresh lease within 60 s",
                    )

                    async def each_answers() -> bool:
                        for a in agents:
                            try:
                                await client.request(
                                    "chaos.echo", {}, agent_id=a.agent_id, timeout=2
                                )
                            except reach.ReachError:
                                return False
                        return True

                    result.check(
                        "every agent answers a direct request after the restart",
                        await within(each_answers, 30) is not None,
                    )
                    await asyncio.sleep(phase)  # the load goes on after the recovery
                finally:
                    await rload.stop()
                    await tload.stop()
                after = rload.answered_since(recovered)
                late = rload.failed_between(recovered)
                result.check(
                    "requests succeed again",
                    after > 0,
                    f"{after} answered, {late} failed after the table recovered",
                )
                result.check(
                    "requests during the outage fail with a clear ReachError",
                    not rload.unclear,
                    f"{rload.failed_between(restarted - outage, recovered)} failed in the"
                    " outage and recovery"
                    + (f"; unclear: {dict(rload.unclear)}" if rload.unclear else ""),
                )
                result.check("no request runs past its deadline", rload.overdue == 0, rload.notes())
                await tload.settle(timeout=180)
            finally:
                for a in agents:
                    await a.stop()
    account(result, requests, tasks, runs)
    result.notes += examples(rload, tload)
    result.check(
        "every accepted task ended SUCCEEDED",
        tasks.ok == len(tload.refs),
        f"{len(tload.refs)} accepted; ends {dict(tload.ended)}",
    )
    result.check(
        "every submit that did not go through raised a clear ReachError",
        not tload.unclear,
        f"longest time without an accepted submit {tload.longest_gap():.1f} s"
        + (f"; unclear: {dict(tload.unclear)}" if tload.unclear else ""),
    )
    return result
