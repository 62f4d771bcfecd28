"""5. A 3-node JetStream cluster, every stream and bucket R3, under request and task load:
SIGKILL the node that leads the task stream, restart it; then SIGKILL a follower (a node
that leads neither the task stream nor the meta group), restart it. One node is down at a
time: R3 keeps a quorum with one node lost; with two lost no write can succeed.

Goals: no lost task (every accepted submit ends SUCCEEDED) and no lost lease (every running
agent stays in the table or comes back, UP); the registry keeps working (an agent started
just as a node dies gets its lease and is UP) and so do clients (requests are answered
while a node is down). The longest write gap (time with no accepted task submit; a submit
writes the task record in KV and the message in the stream) is in the notes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.js.errors

import reach
from reach.testing import NatsCluster, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_b import (
    RequestLoad,
    TableWatch,
    TaskLoad,
    account,
    all_up,
    examples,
    tasks_init,
    within,
)

STREAM = "CHAOS_TASKS"  # the task stream of prefix "chaos"


async def stream_leader(client: reach.Client) -> str:
    """The server name of the task stream's leader, once it has one."""
    js = client.nc.jetstream(timeout=2)
    found: list[str] = []

    async def elected() -> bool:
        try:
            info = await js.stream_info(STREAM)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return False  # no leader to answer yet
        leader = info.cluster.leader if info.cluster is not None else None
        if leader:
            found.append(leader)
        return bool(leader)

    await eventually(elected, timeout=60)
    return found[-1]


async def run(work: Path, short: bool) -> Result:
    result = Result("cluster_failover")
    requests, tasks = Ledger(), Ledger()
    runs = work / "runs"
    phase = 2.0 if short else 8.0
    async with NatsCluster(3) as cluster:
        settings = settings_for(cluster.urls, "chaos", replicas=3)
        agents = [AgentProc(settings, f"echo-{i}", runs) for i in range(2)]
        late: list[AgentProc] = []  # agents started while a node is down
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            table = TableWatch(client)
            try:
                # the streams are made at deploy time: agents starting on a young cluster
                # die if its JetStream is slow to answer (the defect the late agents show)
                tries = await tasks_init(settings)
                if tries > 1:
                    result.notes.append(f"reach tasks init took {tries} runs")
                for a in agents:
                    await a.start()
                await all_up(client, agents)
                await table.start()
                rload = RequestLoad(client, "chaos.echo", requests).start()
                tload = TaskLoad(client, "chaos.job", tasks).start()
                rig = Rig(cluster, settings, client, runs, rload, tload, result, phase, late)
                try:
                    await asyncio.sleep(phase)  # steady state; the task stream exists
                    for n, role in enumerate(("leader", "follower")):
                        await fault(rig, n, role)
                finally:
                    await rload.stop()
                    await tload.stop()
                # every agent that runs: the two, and those that started in a fault
                running = [a for a in agents + late if a.proc and a.proc.returncode is None]
                took = await within(lambda: known(client, "chaos.echo", len(running)), 60)
                result.check(
                    "no lost lease: every running agent UP at the end",
                    took is not None,
                    table.summary([a.agent_id for a in agents + late]),
                )
                await tload.settle(timeout=180)
            finally:
                await table.stop()
                for a in agents + late:
                    await a.stop()
    account(result, requests, tasks, runs)
    result.notes += examples(rload, tload)
    result.notes.append(f"longest write gap {tload.longest_gap():.1f} s")
    result.check(
        "no lost task: every accepted task ended SUCCEEDED",
        tasks.ok == len(tload.refs),
        f"{len(tload.refs)} accepted; ends {dict(tload.ended)}",
    )
    result.check(
        "every submit that did not go through raised a clear ReachError", not tload.unclear
    )
    result.check("requests fail only with a clear ReachError", not rload.unclear)
    return result


@dataclass
class Rig:
    """What a fault works on."""

    cluster: NatsCluster
    settings: reach.ReachSettings
    client: reach.Client
    runs: Path
    rload: RequestLoad
    tload: TaskLoad
    result: Result
    phase: float
    late: list[AgentProc] = field(default_factory=list)


async def fault(rig: Rig, n: int, role: str) -> None:
    """SIGKILL the task stream's leader node (or a follower), start an agent at once (the
    registry keeps working: it gets its lease), let the load run on, restart the node."""
    cluster, client, result, rload, tload = (
        rig.cluster,
        rig.client,
        rig.result,
        rig.rload,
        rig.tload,
    )
    leader = await stream_leader(client)
    if role == "leader":
        victim = leader
    else:  # a node that leads neither the task stream nor the meta group
        meta = cluster.meta_leader()
        others = [m for m in cluster.names if m != leader]
        victim = next((m for m in others if m != meta), others[0])
    i = cluster.names.index(victim)
    down = time.monotonic()
    await cluster.akill_node(i)
    # an agent that starts as the node dies (its streams may have no leader for seconds)
    agent = await AgentProc(rig.settings, f"late-{n}", rig.runs).start()
    rig.late.append(agent)

    async def agent_up() -> bool:
        return any(
            r.info.agent_id == agent.agent_id and r.status is reach.Status.UP
            for r in await client.agents("chaos.echo")
        )

    async def agent_up_or_ended() -> bool:
        return await agent_up() or (agent.proc is not None and agent.proc.returncode is not None)

    wrote = await within(lambda: tload.accepted_since(down) > 0, 60)
    joined = await within(agent_up_or_ended, 60)
    joined = joined if await agent_up() else None
    await asyncio.sleep(rig.phase)  # the load goes on with the node down
    answered, failed = rload.answered_since(down), rload.failed_between(down)
    await cluster.astart_node(i, timeout=60)
    up = time.monotonic()
    result.check(
        f"writes go on with the {role} down",
        wrote is not None,
        f"{victim} killed; longest write gap {tload.longest_gap(down, up):.1f} s;"
        f" the stream's leader now {await stream_leader(client)}",
    )
    result.check(
        f"clients keep working with the {role} down",
        answered > 0,
        f"{answered} requests answered, {failed} failed",
    )
    exited = agent.proc.returncode if agent.proc else None
    result.check(
        f"an agent started while the {role} is down comes UP",
        joined is not None,
        f"{agent.agent_id} UP after {joined:.1f} s"
        if joined is not None
        else f"{agent.agent_id} not UP"
        + (f": its process exited with status {exited} while starting" if exited else " in 60 s"),
    )
    await asyncio.sleep(rig.phase)  # and after its restart
