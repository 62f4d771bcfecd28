"""7. Rolling restart of every agent instance (3) with graceful drain, under request and
task load: SIGTERM one, wait for it to exit, start its replacement, wait until that is UP,
then the next.

Goals: 0 failed requests and 0 lost tasks (every task submitted during the restarts
SUCCEEDED); each old instance exits by itself on SIGTERM (a drain, not a kill).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import reach
from reach.testing import NatsServer, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_a import calls, duplicates, settle_tasks, task_load


async def run(work: Path, short: bool) -> Result:
    result = Result("rolling_restart")
    ledger = Ledger()
    runs = work / "runs"
    steady = 1.0 if short else 5.0
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        agents = [AgentProc(settings, f"echo-{i}", runs) for i in range(3)]
        retired: list[AgentProc] = []
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            for a in agents:
                await a.start()
            try:
                await eventually(lambda: known(client, "chaos.echo", 3), timeout=30)
                stop, by = asyncio.Event(), Counter[str]()
                refs: list[reach.TaskRef] = []
                load = asyncio.gather(
                    calls(client, "chaos.echo", ledger, stop, {}, by),
                    task_load(client, ledger, refs, stop, ms=300, pause=0.05),
                )
                await asyncio.sleep(steady)  # steady state before the restarts
                exits: list[int | None] = []
                took: list[float] = []
                for i, old in enumerate(list(agents)):
                    began = time.monotonic()
                    exits.append(await old.stop(timeout=30))
                    retired.append(old)
                    new = agents[i] = AgentProc(settings, f"echo-{i}-gen2", runs)
                    await new.start()

                    async def up(agent_id: str = new.agent_id) -> bool:
                        records = {r.info.agent_id: r.status for r in await client.agents()}
                        return records.get(agent_id) is reach.Status.UP

                    await eventually(up, timeout=30)
                    took.append(time.monotonic() - began)
                await asyncio.sleep(steady)  # load goes on after the restarts
                stop.set()
                await load
                final = await settle_tasks(client, refs, ledger, timeout=120)
            finally:
                for a in agents + retired:
                    await a.stop()
    ledger.into(result)
    result.duplicated = duplicates(runs)
    result.check(
        "every old instance drained and exited by itself",
        exits == [0, 0, 0],
        "exit codes "
        + ", ".join(str(e) for e in exits)
        + "; restarts took "
        + ", ".join(f"{t:.1f}" for t in took)
        + " s",
    )
    result.check("no failed request", result.failed == 0, f"answered by {dict(sorted(by.items()))}")
    succeeded = sum(r.state is reach.TaskState.SUCCEEDED for r in final.values())
    result.check(
        "no lost task: every task SUCCEEDED",
        succeeded == len(refs) and len(refs) > 0,
        f"{succeeded} of {len(refs)}",
    )
    return result
