"""5. A 3-node JetStream cluster, every stream and bucket R3, under request and task load:
SIGKILL the node that leads the task stream, restart it; then SIGKILL a follower (a node
that leads none of it), restart it. One node is down at a time: R3 keeps a quorum with
one node lost, and with two lost there is none (no write can succeed).

Goals: no lost task (every accepted submit ends SUCCEEDED) and no lost lease (every live
agent stays in the table or comes back, UP); the registry keeps working (an agent started
while a node is down becomes UP) and so do clients (requests are answered while a node is
down). The longest write gap (time with no accepted task submit; a submit writes the task
record in KV and the message in the stream) is in the notes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.js.errors

import reach
from reach.testing import NatsCluster, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_b import RequestLoad, TableWatch, TaskLoad, account, examples

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
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            table = TableWatch(client)
            try:
                for a in agents:
                    await a.start()
                await eventually(lambda: known(client, "chaos.echo", 2), timeout=60)
                await table.start()
                rload = RequestLoad(client, "chaos.echo", requests).start()
                tload = TaskLoad(client, "chaos.job", tasks).start()
                try:
                    await asyncio.sleep(phase)  # steady state; the task stream exists
                    for n, role in enumerate(("leader", "follower")):
                        leader = await stream_leader(client)
                        if role == "leader":
                            victim = leader
                        else:
                            meta = cluster.meta_leader()
                            others = [m for m in cluster.names if m != leader]
                            victim = next((m for m in others if m != meta), others[0])
                        i = cluster.names.index(victim)
                        down = time.monotonic()
                        await cluster.akill_node(i)

                        await eventually(lambda t=down: tload.accepted_since(t) > 0, timeout=60)
                        # the registry keeps working: a new agent gets its lease
                        late = AgentProc(settings, f"late-{n}", runs)
                        agents.append(await late.start())

                        async def late_up(late: AgentProc = late) -> bool:
                            return any(
                                r.info.agent_id == late.agent_id and r.status is reach.Status.UP
                                for r in await client.agents("chaos.echo")
                            )

                        await eventually(late_up, timeout=60)
                        await asyncio.sleep(phase)  # the load goes on with the node down
                        answered = rload.answered_since(down)
                        await cluster.astart_node(i, timeout=60)
                        up = time.monotonic()
                        result.check(
                            f"writes go on with the {role} down",
                            True,
                            f"{victim} killed; longest write gap"
                            f" {tload.longest_gap(down, up):.1f} s; the stream's leader now"
                            f" {await stream_leader(client)}",
                        )
                        result.check(
                            f"the registry and clients keep working with the {role} down",
                            answered > 0,
                            f"{late.agent_id} registered UP; {answered} requests answered,"
                            f" {rload.failed_between(down, up)} failed",
                        )
                        await asyncio.sleep(phase)  # and after its restart
                finally:
                    await rload.stop()
                    await tload.stop()

                async def every_agent_up() -> bool:
                    return await known(client, "chaos.echo", len(agents))

                try:
                    await eventually(every_agent_up, timeout=60)
                    all_up = True
                except TimeoutError:
                    all_up = False
                ids = [a.agent_id for a in agents]
                result.check("no lost lease: every agent UP at the end", all_up, table.summary(ids))
                await tload.settle(timeout=180)
            finally:
                await table.stop()
                for a in agents:
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
