"""11. Periodic schedules through a leader change: a 3-node JetStream cluster, every stream
and bucket R3, two agents serving ``chaos.job``, two schedules firing (``every`` 1 s and
the cron line ``*/2 * * * * *``); SIGKILL the node that leads the task stream (the stream
that holds the schedules and fires them), restart it, and let the schedules fire on.

Goals, counted against the periods each schedule was due in the run: 0 missed (every
period's task ran) and 0 duplicated (no period ran twice: one task id per period, one
run per task). The periods the server could not fire while the stream had no leader are
made up from the next firing; how late they ran is in the notes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import reach
from reach.testing import NatsCluster

from ..harness import AgentProc, Result, settings_for
from ..tools_b import all_up, tasks_init, within
from .cluster_failover import stream_leader

SCHEDULES = {"tick": {"every": 1}, "even": {"cron": "*/2 * * * * *"}}


def runs_by_task(runs: Path) -> Counter[str]:
    """Runs per task id, from the agents' run files (``<task_id>.<attempt>.<pid>``)."""
    return Counter(p.name.split(".")[0] for p in runs.iterdir()) if runs.exists() else Counter()


def due_of(task_id: str) -> tuple[str, int]:
    """(schedule, due unix ms) of a period's task id (``<name>_<unix seconds>``)."""
    name, _, secs = task_id.rpartition("_")
    return name, int(secs) * 1000


async def run(work: Path, short: bool) -> Result:
    result = Result("schedules_failover")
    runs = work / "runs"
    phase = 3.0 if short else 10.0
    async with NatsCluster(3) as cluster:
        settings = settings_for(cluster.urls, "chaos", replicas=3)
        agents = [AgentProc(settings, f"sched-{i}", runs) for i in range(2)]
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            try:
                await tasks_init(settings)
                for a in agents:
                    await a.start()
                await all_up(client, agents)
                first: dict[str, int] = {}
                for name, when in SCHEDULES.items():
                    info = await client.schedule(name, "chaos.job", {"ms": 20}, **when)
                    assert info.next_ms is not None
                    first[name] = info.next_ms
                await asyncio.sleep(phase)  # the schedules fire (the scenario's steady state)
                leader = await stream_leader(client)
                i = cluster.names.index(leader)
                down = time.monotonic()
                await cluster.akill_node(i)
                new_leader = await stream_leader(client)
                elected = time.monotonic() - down
                await asyncio.sleep(phase)  # they fire on under the new leader
                await cluster.astart_node(i, timeout=60)
                await asyncio.sleep(phase)  # and with the old leader back
                end = int(time.time() * 1000)
                result.notes.append(
                    f"{leader} (leader) killed; {new_leader} led after {elected:.1f} s"
                )

                def expected() -> dict[str, set[int]]:
                    out = {}
                    for name, when in SCHEDULES.items():
                        step = 1000 * (when.get("every") or 2)
                        start = first[name]
                        out[name] = set(range(start, end + 1, step))
                    return out

                want = expected()

                def all_ran() -> bool:
                    ran = {due_of(t) for t in runs_by_task(runs)}
                    return all((n, d) in ran for n, dues in want.items() for d in dues)

                took = await within(all_ran, 60)
                for name in SCHEDULES:
                    await client.unschedule(name)
                counts = runs_by_task(runs)
                for name, dues in want.items():
                    mine = {due_of(t)[1]: n for t, n in counts.items() if due_of(t)[0] == name}
                    missed = sorted(dues - set(mine))
                    twice = sorted(d for d, n in mine.items() if n > 1)
                    result.check(
                        f"{name}: 0 periods missed",
                        not missed,
                        f"{len(dues)} periods due, {len(dues) - len(missed)} ran"
                        + (f"; missed {missed[:5]}" if missed else ""),
                    )
                    result.check(
                        f"{name}: 0 periods duplicated",
                        not twice,
                        f"{sum(mine.values())} runs of {len(mine)} periods"
                        + (f"; twice: {twice[:5]}" if twice else ""),
                    )
                late = await _lateness(client, runs)
                result.notes.append(
                    f"all periods ran {took:.1f} s after the end" if took is not None else ""
                )
                result.notes.append(late)
            finally:
                for a in agents:
                    await a.stop()
    return result


async def _lateness(client: reach.Client, runs: Path) -> str:
    """The most a period's run started after its due time, from the task records."""
    worst, n = 0, 0
    for task_id in runs_by_task(runs):
        try:
            rec = await client.task_record(task_id)
        except reach.TaskNotFound:
            continue
        if rec.attempts and rec.due_ms:
            n += 1
            worst = max(worst, rec.attempts[0].started_ms - rec.due_ms)
    return f"{n} periods; the latest started {worst / 1000:.1f} s after its due time"
