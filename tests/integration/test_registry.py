"""Registry: leases in KV, heartbeats into status, probes, replicas, and clients' tables."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest

import reach
from reach import Agent, AgentEvent, Client, ReachSettings, Registry, Status
from reach.testing import NatsServer, eventually, unique_prefix
from reach.wire import Control, ControlReply, ListReply, RouteReply

ROOT = Path(__file__).parents[2]


def fast_settings(url: str) -> ReachSettings:
    """Short leases so silence becomes status within a second or two."""
    return ReachSettings(
        nats_url=url,
        subject_prefix=unique_prefix(),
        heartbeat_interval=0.2,
        lease_ttl=1.0,
        probe_timeout=0.5,
        down_grace=1.0,
        register_backoff=0.05,
        register_backoff_max=0.3,
    )


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def make_agent(settings, agent_id, *, tags=(), capability="geo.lookup", version="1.0"):
    agent = Agent("geo", agent_id, settings=settings, tags=list(tags))

    @agent.capability(capability, version=version)
    async def lookup(q: dict) -> dict:
        return {"by": agent_id}

    return agent


async def table_status(client: Client, agent_id: str) -> Status | None:
    for record in await client.agents():
        if record.info.agent_id == agent_id:
            return record.status
    return None


async def wait_status(client: Client, agent_id: str, status: Status | None, timeout=15.0):
    async def reached():
        return await table_status(client, agent_id) == status

    await eventually(reached, timeout)


class Events:
    """Collects reach.evt.agent.* for a test."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.items: list[AgentEvent] = []

    async def __aenter__(self):
        async def on_event(msg):
            self.items.append(msgspec.json.decode(msg.data, type=AgentEvent))

        self.sub = await self.client.nc.subscribe(self.client.subjects.event("*"), cb=on_event)
        await self.client.flush()
        return self

    async def __aexit__(self, *exc):
        await self.sub.unsubscribe()

    def of(self, agent_id):
        return [
            ("gone" if e.removed else e.new.value, e.reason)
            for e in self.items
            if e.agent_id == agent_id
        ]


async def test_registration_and_record_contents(settings):
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        agent = make_agent(settings, "geo-1", tags=["eu", "gpu"], version="2.3")
        async with agent:
            await wait_status(client, "geo-1", Status.UP)
            await eventually(
                lambda: (
                    "geo-1" in registry.records()
                    and registry.records()["geo-1"].heartbeat is not None
                )
            )
            [record] = await client.agents("geo.lookup")
            assert record.info.name == "geo"
            assert record.info.tags == ["eu", "gpu"]
            assert [(c.name, c.version) for c in record.info.capabilities] == [
                ("geo.lookup", "2.3")
            ]
            assert record.transitions[-1].reason == "registered"
            assert record.registered_ms > 0
            # requests now go to the instance the table chose, on its direct subject
            reply = await client.call("geo.lookup", {})
            assert reply.agent_id == "geo-1"
            assert (await client.agents("nothing.here")) == []


async def test_sigkill_goes_unknown_then_down_then_gone_with_events_in_order(settings):
    env = {
        **os.environ,
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "REACH_HEARTBEAT_INTERVAL": "0.2",
        "REACH_LEASE_TTL": "1",
    }
    async with (
        Registry(settings=settings),
        Client(settings=settings) as client,
        Events(client) as events,
    ):
        if True:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "sdk" / "examples" / "logistics.py"),
                env=env,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                await eventually(lambda: client.agents("logistics.track"), 15)
                agent_id = (await client.agents("logistics.track"))[0].info.agent_id
                await wait_status(client, agent_id, Status.UP)
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
            # UNKNOWN lasts only as long as the probe (no responders: about a millisecond), so
            # the events show it; the table is checked for the states that last.
            await eventually(lambda: ("UNKNOWN", "no heartbeat for 1s") in events.of(agent_id))
            await wait_status(client, agent_id, Status.DOWN)
            await wait_status(client, agent_id, None)
            await eventually(lambda: events.of(agent_id)[-1:] == [("gone", "grace period over")])
    assert events.of(agent_id) == [
        ("UP", "registered"),
        ("UNKNOWN", "no heartbeat for 1s"),
        ("DOWN", "probe failed: no responders"),
        ("gone", "grace period over"),
    ]
    async with Client(settings=settings) as fresh:
        with pytest.raises(reach.CapabilityNotFound):
            await fresh.request("logistics.track", {"order_id": "x"})


async def test_silent_but_alive_agent_is_probed_back_up(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        agent = make_agent(settings, "geo-quiet")
        async with Events(client) as events, agent:
            await wait_status(client, "geo-quiet", Status.UP)
            # Stop heartbeating without stopping: only the probe can tell it is alive.
            await agent.presence.stop()
            await eventually(lambda: ("UP", "probe answered") in events.of("geo-quiet"))
            assert await client.request("geo.lookup", {}) == {"by": "geo-quiet"}
    assert events.of("geo-quiet")[:3] == [
        ("UP", "registered"),
        ("UNKNOWN", "no heartbeat for 1s"),
        ("UP", "probe answered"),
    ]


async def control(client: Client, agent_id: str, command: str) -> ControlReply:
    msg = await client.nc.request(
        client.subjects.ctl(agent_id), msgspec.json.encode(Control(command=command)), timeout=5
    )
    return msgspec.json.decode(msg.data, type=ControlReply)


async def test_pause_resume_drain_transitions(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        agent = make_agent(settings, "geo-ctl")
        served = asyncio.create_task(agent.serve_forever())
        async with Events(client) as events:
            await wait_status(client, "geo-ctl", Status.UP)
            assert (await control(client, "geo-ctl", "pause")).status == Status.PAUSED
            await wait_status(client, "geo-ctl", Status.PAUSED)
            with pytest.raises(reach.CapabilityNotFound, match="PAUSED"):
                await client.request("geo.lookup", {})
            assert (await control(client, "geo-ctl", "resume")).status == Status.UP
            await wait_status(client, "geo-ctl", Status.UP)
            assert await client.request("geo.lookup", {}) == {"by": "geo-ctl"}
            assert (await control(client, "geo-ctl", "drain")).status == Status.PAUSED
            async with asyncio.timeout(15):
                await served
            await wait_status(client, "geo-ctl", None)
            await eventually(lambda: events.of("geo-ctl")[-1:] == [("gone", "deregistered")])
    assert events.of("geo-ctl") == [
        ("UP", "registered"),
        ("PAUSED", "reported"),
        ("UP", "reported"),
        ("PAUSED", "reported"),
        ("gone", "deregistered"),
    ]


async def test_bad_control_commands_get_bad_request(settings):
    async with make_agent(settings, "geo-bad"), Client(settings=settings) as client:
        for body in (b"nonsense", msgspec.json.encode(Control(command="explode"))):
            msg = await client.nc.request(client.subjects.ctl("geo-bad"), body, timeout=5)
            assert msg.headers["Nats-Service-Error-Code"] == "400"


async def test_registry_restart_heals_without_restarting_agents(nats_server, settings):
    env = {
        **os.environ,
        "REACH_NATS_URL": nats_server.url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "REACH_HEARTBEAT_INTERVAL": "0.2",
        "REACH_LEASE_TTL": "1",
    }

    async def start_registry():
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reach.cli",
            "registry",
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(30):
            while b"registry" not in await proc.stderr.readline():
                pass
        return proc

    async with Client(settings=settings) as client:
        registry = await start_registry()
        agents = [make_agent(settings, f"geo-r{i}") for i in range(3)]
        try:
            for a in agents:
                await a.start()
            for a in agents:
                await wait_status(client, a.agent_id, Status.UP)
            os.kill(registry.pid, signal.SIGKILL)
            await registry.wait()
            # No registry: the server itself expires the leases.
            for a in agents:
                await wait_status(client, a.agent_id, None)
            # Requests still work through the queue group.
            assert (await client.request("geo.lookup", {}))["by"].startswith("geo-r")
            registry = await start_registry()
            for a in agents:
                await wait_status(client, a.agent_id, Status.UP)
        finally:
            for a in agents:
                await a.stop()
            registry.send_signal(signal.SIGTERM)
            await registry.wait()


async def test_two_registries_one_record_per_agent_no_lost_updates(settings):
    async with Registry(settings=settings) as r1, Registry(settings=settings) as r2:
        agents = [make_agent(settings, f"geo-t{i}") for i in range(6)]
        for a in agents:
            await a.start()
        try:
            async with Client(settings=settings) as client:
                for a in agents:
                    await wait_status(client, a.agent_id, Status.UP)
                seqs = {a.agent_id: a.presence.seq for a in agents}
                await eventually(
                    lambda: all(a.presence.seq >= seqs[a.agent_id] + 10 for a in agents)
                )
                # Every registry's view ends at each agent's latest heartbeat.
                for reg in (r1, r2):
                    await eventually(
                        lambda reg=reg: all(
                            (rec := reg.records().get(a.agent_id)) is not None
                            and rec.heartbeat is not None
                            and rec.heartbeat.seq >= a.presence.seq - 1
                            for a in agents
                        )
                    )
                kv = await client.nc.jetstream().key_value(client.subjects.bucket("agents"))
                keys = sorted(await kv.keys())
                assert keys == sorted(a.agent_id for a in agents)
        finally:
            for a in agents:
                await a.stop()
    assert r1.stats.heartbeats > 0
    assert r2.stats.heartbeats > 0  # the queue group spread the work
    assert r1.stats.write_errors == r2.stats.write_errors == 0


async def test_lease_expiry_with_no_registry_running(settings):
    async with Client(settings=settings) as client:
        registry = Registry(settings=settings)
        await registry.start()
        async with make_agent(settings, "geo-lonely"):
            await wait_status(client, "geo-lonely", Status.UP)
            await registry.stop()
            await wait_status(client, "geo-lonely", None)
            # and the table empty for it means: fall back to the queue group
            assert await client.request("geo.lookup", {}) == {"by": "geo-lonely"}


async def test_malformed_and_spoofed_heartbeats_are_dropped_and_counted(settings):
    async with (
        Registry(settings=settings) as registry,
        Client(settings=settings) as client,
        make_agent(settings, "geo-real") as agent,
    ):
        if True:
            await wait_status(client, "geo-real", Status.UP)
            nc = client.nc
            await nc.publish(client.subjects.heartbeat("geo-real"), b"{not json")
            await nc.publish(client.subjects.heartbeat("geo-real"), b'{"type":"x"}')
            spoof = agent.heartbeat(999)
            await nc.publish(client.subjects.heartbeat("geo-other"), msgspec.json.encode(spoof))
            await client.flush()
            await eventually(
                lambda: (
                    registry.stats.dropped_malformed == 2 and registry.stats.dropped_spoofed == 1
                )
            )
            seq = agent.presence.seq
            await eventually(
                lambda: (
                    (rec := registry.records().get("geo-real")) is not None
                    and rec.heartbeat is not None
                    and rec.heartbeat.seq > seq
                )
            )
            assert "geo-other" not in registry.records()


async def test_list_and_route_api_for_thin_clients(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        a = make_agent(settings, "geo-eu", tags=["eu"])
        b = make_agent(settings, "geo-us", tags=["us"])
        async with a, b:
            await wait_status(client, "geo-eu", Status.UP)
            await wait_status(client, "geo-us", Status.UP)
            nc = client.nc
            msg = await nc.request(client.subjects.registry("list"), b'{"tag": "eu"}', timeout=5)
            listed = msgspec.json.decode(msg.data, type=ListReply)
            assert [r.info.agent_id for r in listed.agents] == ["geo-eu"]
            msg = await nc.request(
                client.subjects.registry("route"), b'{"capability": "geo.lookup"}', timeout=5
            )
            route = msgspec.json.decode(msg.data, type=RouteReply)
            assert {c.agent_id for c in route.candidates} == {"geo-eu", "geo-us"}
            assert route.candidates[0].subject.endswith(".geo.lookup")
            assert all(c.score > 0 and c.reason for c in route.candidates)
            msg = await nc.request(
                client.subjects.registry("route"),
                b'{"capability": "geo.lookup", "tags": ["gpu"]}',
                timeout=5,
            )
            route = msgspec.json.decode(msg.data, type=RouteReply)
            assert route.candidates == []
            assert "lack tag 'gpu'" in route.reason
            msg = await nc.request(client.subjects.registry("route"), b"[1,2]", timeout=5)
            assert msg.headers["Nats-Service-Error-Code"] == "400"


async def test_capability_not_found_says_what_was_asked_and_what_exists(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        a = make_agent(settings, "geo-c1", tags=["cpu"])
        b = make_agent(settings, "geo-c2", tags=["cpu"])
        async with a, b:
            await wait_status(client, "geo-c1", Status.UP)
            await wait_status(client, "geo-c2", Status.UP)
            with pytest.raises(
                reach.CapabilityNotFound, match="2 instances offer it but lack tag 'gpu'"
            ):
                await client.request("geo.lookup", {}, required_tags=["gpu"])
            with pytest.raises(reach.CapabilityNotFound, match=r"offer version 1\.0, not 2\.x"):
                await client.request("geo.lookup", {}, version="2.0")
            assert (await client.request("geo.lookup", {}, version="1.4", required_tags=["cpu"]))[
                "by"
            ] in {"geo-c1", "geo-c2"}


async def test_nats_server_restart_on_same_store_table_recovers(tmp_path):
    server = NatsServer(store_dir=tmp_path / "js").start()
    try:
        settings = fast_settings(server.url)
        async with (
            Registry(settings=settings) as registry,
            Client(settings=settings) as client,
            make_agent(settings, "geo-phoenix"),
        ):
            if True:
                await wait_status(client, "geo-phoenix", Status.UP)
                server.kill()
                await eventually(lambda: not client.connected)
                server.start()
                await eventually(lambda: client.connected, timeout=30)
                # The bucket lived in memory: the registry recreates it and the agent's
                # next heartbeat makes it register again; the table follows.
                await eventually(lambda: registry.records().get("geo-phoenix"), timeout=30)
                await wait_status(client, "geo-phoenix", Status.UP, timeout=30)
                assert await client.request("geo.lookup", {}) == {"by": "geo-phoenix"}
    finally:
        server.close()


async def test_agent_without_registry_keeps_serving_and_registers_when_one_appears(settings):
    async with Client(settings=settings) as client, make_agent(settings, "geo-early") as agent:
        assert not agent.presence.registered
        assert await client.request("geo.lookup", {}) == {"by": "geo-early"}
        async with Registry(settings=settings) as registry:
            await eventually(lambda: "geo-early" in registry.records())
            await wait_status(client, "geo-early", Status.UP)
        assert agent.presence.registered
