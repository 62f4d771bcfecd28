"""Broadcast fan-out and the NATS services discovery protocol."""

import asyncio

import msgspec

from reach import Agent, Client
from reach.testing import eventually


async def test_broadcast_reaches_every_instance_and_wildcards(reach_settings, reach_client):
    heard: dict[str, list] = {}

    def listener(agent_id, pattern):
        agent = Agent("listener", agent_id, settings=reach_settings)

        @agent.on_topic(pattern)
        async def on_status(update: dict, topic: str) -> None:
            heard.setdefault(agent_id, []).append((topic, update["order"]))

        return agent

    agents = [
        listener("l-1", "order.status"),
        listener("l-2", "order.status"),
        listener("l-3", "order.*"),
        listener("l-4", "other"),
    ]
    for agent in agents:
        await agent.start()
    try:
        sub = await reach_client.subscribe("order.>")
        async with sub:
            for i in range(5):
                await reach_client.publish("order.status", {"order": i})
            await reach_client.publish("order.refund", {"order": 99})
            got = [await sub.next(timeout=5) for _ in range(6)]
        await eventually(lambda: len(heard.get("l-3", [])) == 6)
        await eventually(lambda: len(heard.get("l-1", [])) == 5 and len(heard.get("l-2", [])) == 5)
    finally:
        for agent in agents:
            await agent.stop()
    expected = [("order.status", i) for i in range(5)]
    assert heard["l-1"] == expected
    assert heard["l-2"] == expected
    assert heard["l-3"] == [*expected, ("order.refund", 99)]
    assert "l-4" not in heard
    assert [m.topic for m in got] == ["order.status"] * 5 + ["order.refund"]
    assert got[0].json() == {"order": 0}


async def test_bad_topic_messages_are_counted_and_do_not_stop_delivery(
    reach_settings, reach_client
):
    class Update(msgspec.Struct):
        order: int

    seen = []
    agent = Agent("typed", settings=reach_settings)

    @agent.on_topic("order.status")
    async def on_update(update: Update) -> None:
        seen.append(update.order)

    async with agent:
        await reach_client.publish("order.status", b"garbage")
        await reach_client.publish("order.status", {"order": "x"})
        await reach_client.publish("order.status", {"order": 7})
        await eventually(lambda: seen == [7])
    assert agent.stats.invalid == 2


async def srv_collect(client: Client, subject: str, want: int) -> list[dict]:
    nc = client.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    out = []
    async with asyncio.timeout(10):
        while len(out) < want:
            out.append(msgspec.json.decode((await sub.next_msg(timeout=10)).data))
    await sub.unsubscribe()
    return out


async def test_srv_ping_info_stats_list_agents_and_capabilities(reach_settings, reach_client):
    a = Agent("srvtest", "srv-a", settings=reach_settings, tags=["eu"])
    b = Agent("srvtest", "srv-b", settings=reach_settings)
    for agent in (a, b):

        @agent.capability("geo.lookup", version="2.1")
        async def lookup(q: dict) -> dict:
            return q

    async with a, b:
        await reach_client.request("geo.lookup", {"x": 1}, agent_id="srv-a")
        pings = await srv_collect(reach_client, "$SRV.PING.srvtest", 2)
        info = (await srv_collect(reach_client, "$SRV.INFO.srvtest.srv-a", 1))[0]
        stats = (await srv_collect(reach_client, "$SRV.STATS.srvtest.srv-a", 1))[0]
    assert {p["id"] for p in pings} == {"srv-a", "srv-b"}
    assert all(p["type"] == "io.nats.micro.v1.ping_response" for p in pings)
    assert info["type"] == "io.nats.micro.v1.info_response"
    [endpoint] = info["endpoints"]
    assert endpoint["name"] == "geo.lookup"
    assert endpoint["subject"] == reach_client.subjects.cap("geo.lookup")
    assert endpoint["queue_group"] == "cap.geo.lookup"
    assert endpoint["metadata"]["version"] == "2.1"
    assert info["metadata"]["reach.tags"] == "eu"
    assert stats["endpoints"][0]["num_requests"] == 1
    assert stats["endpoints"][0]["num_errors"] == 0


async def test_srv_discovery_works_with_nats_micro_client_parsing(reach_settings, reach_client):
    """nats-py's own micro types parse our answers (what standard tooling does)."""
    from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

    agent = Agent("microcompat", "mc-1", settings=reach_settings)

    @agent.capability("mc.op")
    async def op(q: dict) -> dict:
        return q

    async with agent:
        ping = (await srv_collect(reach_client, "$SRV.PING.microcompat", 1))[0]
        info = (await srv_collect(reach_client, "$SRV.INFO.microcompat", 1))[0]
        stats = (await srv_collect(reach_client, "$SRV.STATS.microcompat", 1))[0]
    assert ServicePing.from_dict(ping).id == "mc-1"
    assert [e.name for e in ServiceInfo.from_dict(info).endpoints] == ["mc.op"]
    assert ServiceStats.from_dict(stats).endpoints[0].name == "mc.op"
