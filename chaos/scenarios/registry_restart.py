"""6. The registry (a process of its own, ``python -m reach.cli registry``) SIGKILLed and
restarted; then, separately, two registries with one SIGKILLed. Under request and task
load, with an agent SIGKILLed in the middle of a task in each part.

Part 1: the only registry is killed just after it renewed one agent's lease, and that agent
with it. While no registry runs, the leases expire (the server's own TTL), the live agent's
first, and then requests go by the queue group; the dead agent's task is redelivered to the
other one. The registry is restarted, then the agent (same id).
Part 2: a second registry joins; the first is killed, and the other agent with it; the
survivor keeps the live agent UP and finds the dead one.

Goals: no request fails because of it (0 failed); task recovery goes on: every task whose
agent was killed under it is finished (by another agent, or after the restart), every
accepted task SUCCEEDED.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import reach
from reach.testing import NatsServer

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_b import (
    RegistryProc,
    RequestLoad,
    TableWatch,
    TaskLoad,
    account,
    all_up,
    examples,
    kill_mid_task,
    next_write,
    within,
)


async def up_since(client: reach.Client, agent_id: str, since_ms: int) -> bool:
    """``agent_id`` is UP on a lease written at or after ``since_ms`` (wall clock)."""
    return any(
        r.info.agent_id == agent_id and r.status is reach.Status.UP and r.last_seen_ms >= since_ms
        for r in await client.agents()
    )


async def gone_or_down(client: reach.Client, agent_id: str) -> bool:
    records = {r.info.agent_id: r.status for r in await client.agents()}
    return records.get(agent_id) in (None, reach.Status.DOWN)


async def run(work: Path, short: bool) -> Result:
    result = Result("registry_restart")
    requests, tasks = Ledger(), Ledger()
    runs = work / "runs"
    phase = 1.5 if short else 6.0
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        # a slow job, so that a killed agent dies with a task in hand
        agents = [AgentProc(settings, f"echo-{i}", runs) for i in range(2)]
        registries: list[RegistryProc] = []
        victims: list[str] = []
        table = None
        marks: list[tuple[str, float]] = []
        async with reach.Client(settings=settings) as client:
            try:
                registries.append(await RegistryProc(settings, work / "registry-1.log").start())
                for a in agents:
                    await a.start()
                await all_up(client, agents)
                rload = RequestLoad(client, "chaos.echo", requests).start()
                tload = TaskLoad(client, "chaos.job", tasks, job_ms=300, pause=0.05).start()
                marks.append(("steady", time.monotonic()))
                try:
                    await asyncio.sleep(phase)  # steady state
                    # -- part 1: the only registry killed, and an agent with it --------------
                    # just after it renewed that agent's lease: the dead agent's lease is
                    # then the last to lapse, up to a heartbeat after the live one's
                    await next_write(client, agents[0].agent_id)
                    await registries[0].kill()
                    alone = time.monotonic()
                    marks.append(("no registry", alone))
                    await kill_mid_task(agents[0])
                    victims.append(agents[0].agent_id)
                    # long enough for every lease to expire with no registry to renew it
                    await asyncio.sleep(settings.lease_ttl + phase)
                    answered = rload.answered_since(alone)
                    registries.append(await RegistryProc(settings, work / "registry-2.log").start())
                    marks.append(("registry restarted", time.monotonic()))
                    back_ms = int(time.time() * 1000)
                    took = await within(lambda: up_since(client, "echo-1", back_ms), 60)
                    result.check(
                        "requests are answered while no registry runs",
                        answered > 0,
                        f"{answered} answered",
                    )
                    result.check(
                        "a restarted registry takes the live agent back UP",
                        took is not None,
                        f"{took:.1f} s" if took is not None else "not within 60 s",
                    )
                    agents[0] = await AgentProc(settings, "echo-0", runs).start()
                    marks.append(("echo-0 restarted", time.monotonic()))
                    result.check(
                        "the killed agent, restarted, is UP again",
                        await within(lambda: known(client, "chaos.echo", 2), 60) is not None,
                    )
                    await asyncio.sleep(phase)
                    # -- part 2: two registries, one killed, and an agent with it ------------
                    registries.append(await RegistryProc(settings, work / "registry-3.log").start())
                    table = await TableWatch(client).start()
                    await asyncio.sleep(phase)  # both registries take heartbeats
                    marks.append(("two registries", time.monotonic()))
                    await registries[1].kill()
                    marks.append(("one of two killed", time.monotonic()))
                    await kill_mid_task(agents[1])
                    victims.append(agents[1].agent_id)
                    found = await within(lambda: gone_or_down(client, "echo-1"), 60)
                    result.check(
                        "the surviving registry finds the dead agent DOWN",
                        found is not None,
                        f"{found:.1f} s" if found is not None else "not within 60 s",
                    )
                    await asyncio.sleep(phase)
                    stayed = table.left["echo-0"] == 0 and table.statuses.get("echo-0", set()) <= {
                        reach.Status.UP
                    }
                    result.check(
                        "with one of two registries killed, the live agent stays UP",
                        stayed,
                        table.summary(["echo-0"]),
                    )
                finally:
                    await rload.stop()
                    await tload.stop()
                await tload.settle(timeout=180)
            finally:
                if table is not None:
                    await table.stop()
                for a in agents:
                    await a.stop()
                for r in registries:
                    await r.stop()
    account(result, requests, tasks, runs)
    result.notes += examples(rload, tload)
    result.check("no failed request", requests.ok == requests.sent, rload.notes())
    result.notes.append(rload.per_phase(marks))
    orphans = [
        rec
        for rec in tload.records
        if any(a.agent_id in victims and a.outcome == "lost" for a in rec.attempts)
    ]
    finished = [r for r in orphans if r.state is reach.TaskState.SUCCEEDED]
    result.check(
        "task recovery goes on: the tasks of killed agents are finished",
        bool(orphans) and len(finished) == len(orphans),
        f"{len(finished)} of {len(orphans)} tasks lost with {'/'.join(victims)} finished, by "
        + ", ".join(sorted({r.agent_id for r in finished})),
    )
    result.check(
        "every accepted task ended SUCCEEDED",
        tasks.ok == len(tload.refs),
        f"{len(tload.refs)} accepted; ends {dict(tload.ended)}",
    )
    result.check("every submit went through or raised a clear ReachError", not tload.unclear)
    return result
