"""Replicas share the work: two registries in the heartbeat queue group both take
heartbeats, and when one of them crashes (a ``reach registry`` process, SIGKILLed) the
other takes every heartbeat from then on, so no lease expires and no agent leaves the
table."""

import asyncio
import math
import os
import re
import signal
import sys
import time
import urllib.request

import msgspec

from reach import Agent, AgentEvent, AgentRecord, Client, Registry, Status
from reach.testing import eventually

from .registry_wire import fast_settings, stored

AGENTS = 4


async def start_victim(env: dict[str, str]) -> tuple[asyncio.subprocess.Process, str]:
    """A ``reach registry`` process and its /metrics URL, from its start line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reach.cli", "registry", env=env, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    async with asyncio.timeout(30):
        while line := await proc.stderr.readline():
            found = re.match(rb"# registry .*, metrics (\S+)", line)
            if found:
                return proc, found[1].decode()
    raise AssertionError(f"registry exited with {await proc.wait()} before it was ready")


async def heartbeats_taken(metrics_url: str) -> float:
    """The ``reach_registry_heartbeats_total`` a registry process reports."""
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=5).read())
    found = re.search(rb"^reach_registry_heartbeats_total (\S+)$", body, re.M)
    assert found is not None, body[:500]
    return float(found[1])


def make_agent(settings, agent_id: str) -> Agent:
    agent = Agent("geo", agent_id, settings=settings)

    @agent.capability("geo.lookup")
    async def lookup(q: dict) -> dict:
        return {"by": agent_id}

    return agent


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def test_losing_one_of_two_replicas_loses_no_lease(nats_server):
    # A lease of 10 heartbeats; the registry renews it every lease/3 - interval/2 (~0.57 s).
    settings = fast_settings(nats_server.url, lease_ttl=2.0)
    ttl = settings.lease_ttl
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "REACH_HEARTBEAT_INTERVAL": str(settings.heartbeat_interval),
        "REACH_LEASE_TTL": str(ttl),
        "REACH_PROBE_TIMEOUT": str(settings.probe_timeout),
        "REACH_DOWN_GRACE": str(settings.down_grace),
        "REACH_METRICS_PORT": "0",
    }
    ids = [f"geo-rep{i}" for i in range(AGENTS)]
    agents = [make_agent(settings, agent_id) for agent_id in ids]

    changes: list[AgentRecord | str] = []
    events: list[AgentEvent] = []
    victim: asyncio.subprocess.Process | None = None
    draining: asyncio.Task[None] | None = None
    async with Registry(settings=settings) as survivor, Client(settings=settings) as client:

        async def follow() -> None:
            async for change in client.changes():
                changes.append(change)

        async def on_event(msg) -> None:
            events.append(msgspec.json.decode(msg.data, type=AgentEvent))

        sub = await client.nc.subscribe(client.subjects.event("*"), cb=on_event)
        await client.flush()
        following = asyncio.create_task(follow())
        try:
            victim, metrics_url = await start_victim(env)
            assert victim.stderr is not None
            draining = asyncio.create_task(drain(victim.stderr))
            for agent in agents:
                await agent.start()

            def all_up_in_changes() -> bool:
                up = {c.info.agent_id for c in changes if isinstance(c, AgentRecord)}
                return up >= set(ids)

            await eventually(all_up_in_changes, 15)  # the follower sees the table move

            # Both replicas take heartbeats (the queue group shares them) before the crash.
            async def both_take_heartbeats() -> bool:
                return survivor.stats.heartbeats > 0 and await heartbeats_taken(metrics_url) > 0

            await eventually(both_take_heartbeats, 15)

            os.kill(victim.pid, signal.SIGKILL)
            await victim.wait()
            killed_at = time.monotonic()
            taken_at_kill = survivor.stats.heartbeats
            sent_at_kill = {a.agent_id: a.presence.seq for a in agents}
            seen_at_kill = len(changes)
            # A heartbeat is never sent early, so once each agent has sent this many more,
            # at least two leases have passed since the crash.
            more = math.ceil(2 * ttl / settings.heartbeat_interval) + 1
            target = {a: sent_at_kill[a] + more for a in ids}

            async def renewed_past_two_leases() -> bool:
                for agent_id in ids:
                    record = await stored(client.nc, settings, agent_id)
                    if record is None or record.heartbeat is None:
                        return False
                    if record.heartbeat.seq < target[agent_id]:
                        return False
                return True

            await eventually(renewed_past_two_leases, 2 * ttl + 20)
            assert time.monotonic() - killed_at >= 2 * ttl

            # Every heartbeat sent since the crash went to the survivor, but for at most one
            # per agent that the server handed to the dead replica before it saw it gone.
            sent = sum(a.presence.seq - sent_at_kill[a.agent_id] for a in agents)
            await eventually(lambda: survivor.stats.heartbeats - taken_at_kill >= sent - AGENTS)

            # and the client following the table saw those writes too
            def followed() -> bool:
                newest = dict.fromkeys(ids, 0)
                for c in changes[seen_at_kill:]:
                    if isinstance(c, AgentRecord) and c.heartbeat is not None:
                        agent_id = c.info.agent_id
                        newest[agent_id] = max(newest[agent_id], c.heartbeat.seq)
                return all(newest[a] >= target[a] for a in ids)

            await eventually(followed)
            await client.flush()
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await sub.unsubscribe()
            for agent in agents:
                await agent.stop()
            if victim is not None and victim.returncode is None:
                victim.kill()
                await victim.wait()
            if draining is not None:
                draining.cancel()
                await asyncio.gather(draining, return_exceptions=True)

        # No lease expired: no agent left the table, none was ever anything but UP, no
        # expiry was probed, no agent was asked to register again.
        assert [c for c in changes if isinstance(c, str)] == []
        assert {c.status for c in changes if isinstance(c, AgentRecord)} == {Status.UP}
        assert client.stats.changes_dropped == 0
        assert sorted((e.agent_id, e.new, e.reason, e.removed) for e in events) == [
            (agent_id, Status.UP, "registered", False) for agent_id in ids
        ]
        assert survivor.stats.probes == 0
        assert survivor.stats.reregister_requests == 0
        assert survivor.stats.write_errors == 0
