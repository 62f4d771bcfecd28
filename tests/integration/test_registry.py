"""Registry: leases in KV, heartbeats into status, probes, replicas, and clients' tables."""

import asyncio
import os
import signal
import sys
import time

import msgspec
import nats.js.api
import pytest

import reach
from reach import Agent, AgentEvent, Client, Registry, Status
from reach._codec import now_ms
from reach.testing import NatsServer, eventually
from reach.wire import Control, ControlReply, ListReply, RouteReply

from .registry_wire import Relay, WireAgent, beat, fast_settings, heartbeat, info, register, stored


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
            # an honest agent's numbers are stored as sent
            assert registry.stats.clamped == registry.stats.dropped_invalid == 0


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
                "-m",
                "reach.examples.logistics",
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
    """An agent that stops heartbeating but still answers $ping (played over plain NATS)."""
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with Events(client) as events, WireAgent(client.nc, settings, "geo-quiet"):
            await eventually(lambda: ("UP", "probe answered") in events.of("geo-quiet"))
            await wait_status(client, "geo-quiet", Status.UP)
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


async def test_two_registries_race_on_one_key_and_the_newest_heartbeat_wins(settings):
    """Both replicas write the same key at once: compare-and-set conflicts happen, are
    retried on the fresh record, and the record ends at the newest heartbeat."""
    async with (
        Registry(settings=settings) as r1,
        Registry(settings=settings) as r2,
        Client(settings=settings) as client,
    ):
        nc = client.nc
        reply = await register(nc, settings, info("geo-race"))
        assert not reply.headers, reply.headers
        await eventually(lambda: "geo-race" in r1.records() and "geo-race" in r2.records())
        seq = 0

        async def raced() -> bool:
            # The heartbeat subscription is a queue group: a burst lands on both replicas,
            # and both renew the one key while the other's write is still on its way.
            # Each heartbeat says something new (its reason), so each one is written.
            nonlocal seq
            for _ in range(40):
                seq += 1
                news = f"burst {seq}"
                body = beat("geo-race", seq, reason=news, sent_ms=int(time.time() * 1000))
                await heartbeat(nc, settings, "geo-race", body)
            await client.flush()
            return (
                r1.stats.cas_conflicts + r2.stats.cas_conflicts > 0
                and r1.stats.heartbeats > 0
                and r2.stats.heartbeats > 0
            )

        await eventually(raced, timeout=30)

        async def newest() -> bool:
            record = await stored(nc, settings, "geo-race")
            return (
                record is not None
                and record.heartbeat is not None
                and (record.heartbeat.seq == seq)
            )

        await eventually(newest)
        record = await stored(nc, settings, "geo-race")
        assert record.status == Status.UP
        assert [t.reason for t in record.transitions] == ["registered"]
        for reg in (r1, r2):
            await eventually(
                lambda reg=reg: reg.records()["geo-race"].heartbeat.seq == seq  # type: ignore
            )
            assert reg.stats.write_errors == 0
        kv = await nc.jetstream().key_value(client.subjects.bucket("agents"))
        assert await kv.keys() == ["geo-race"]


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
            hb = registry.records()["geo-real"].heartbeat
            seq = hb.seq if hb is not None else 0
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
    async with NatsServer(store_dir=tmp_path / "js") as server:
        settings = fast_settings(server.url)
        async with (
            Registry(settings=settings) as registry,
            Client(settings=settings) as client,
            make_agent(settings, "geo-phoenix"),
        ):
            await wait_status(client, "geo-phoenix", Status.UP)
            # A long-lived bucket: its revisions are far ahead of those a new one starts at.
            kv = await client.nc.jetstream().key_value(client.subjects.bucket("agents"))
            for _ in range(1000):
                await kv.put("filler", b"x")
            filled_ms = now_ms()
            # the registry holds the agent at a revision after the filler
            await eventually(lambda: registry.records()["geo-phoenix"].last_seen_ms > filled_ms)
            killed_ms = now_ms()
            api = registry._core.api  # its lease writes' request inbox, for the connection
            assert api is not None
            sent = api._inbox._seq
            await server.akill()
            await eventually(lambda: not client.connected)
            await server.astart()
            await eventually(lambda: client.connected, timeout=30)

            # The bucket lived in memory: the registry recreates it and the agent's
            # next heartbeat makes it register again, into the NEW bucket ...
            async def registered_again() -> bool:
                record = await stored(client.nc, settings, "geo-phoenix")
                return record is not None and record.registered_ms > killed_ms

            await eventually(registered_again, timeout=30)
            # through the same inbox: nats-py renewed its subscription on the reconnect
            assert registry._core.api is api
            assert api._inbox._seq > sent

            # ... and the registry's own view follows the new bucket, not the old one.
            def view_follows() -> bool:
                record = registry.records().get("geo-phoenix")
                return record is not None and record.registered_ms > killed_ms

            await eventually(view_follows, timeout=30)
            assert await client.request("geo.lookup", {}) == {"by": "geo-phoenix"}


async def test_registry_view_follows_a_bucket_created_again(settings):
    """A new bucket's revisions start at 1 again: the registry's view must follow the new
    stream even when it finds the key there at a lower revision than it knew."""
    async with Relay(settings.nats_url) as relay, Client(settings=settings) as client:
        nc = client.nc
        js = nc.jetstream()
        bucket = client.subjects.bucket("agents")
        async with Registry(relay.url, settings=settings) as registry:
            async with WireAgent(nc, settings, "geo-twice"):
                bound = await js.key_value(bucket)
                for _ in range(50):  # the old bucket's revisions run ahead
                    await bound.put("filler", b"x")
                await register(nc, settings, info("geo-twice"))
                await eventually(lambda: "geo-twice" in registry.records())
                old = registry.records()["geo-twice"]
                relay.cut()  # the registry is away while the bucket is created again
                await eventually(lambda: relay.open == 0)
                await js.delete_key_value(bucket)
                new_kv = await js.create_key_value(
                    bucket=bucket, history=1, storage=nats.js.api.StorageType.MEMORY
                )
                fresh = msgspec.structs.replace(old, status=Status.PAUSED, registered_ms=1)
                await new_kv.put("geo-twice", msgspec.json.encode(fresh))
                relay.mend()

                def follows() -> bool:
                    record = registry.records().get("geo-twice")
                    return record is not None and record.registered_ms == 1

                await eventually(follows, timeout=20)
                await new_kv.delete("geo-twice")  # the new stream's next revision counts too
                await eventually(lambda: "geo-twice" not in registry.records())


async def test_agent_without_registry_keeps_serving_and_registers_when_one_appears(settings):
    async with Client(settings=settings) as client, make_agent(settings, "geo-early"):
        assert await stored(client.nc, settings, "geo-early") is None
        assert await client.request("geo.lookup", {}) == {"by": "geo-early"}
        async with Registry(settings=settings) as registry:
            await eventually(lambda: "geo-early" in registry.records())
            await wait_status(client, "geo-early", Status.UP)
