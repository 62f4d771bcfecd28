"""Writes that carry news: a registry writes a heartbeat when it changes what routing or
people read (status, reason, a load, queue or latency move past its threshold) or when the
lease is due for renewal (older than ``lease_ttl/3 - heartbeat_interval/2``), and no other.
A live agent's lease never expires, through two replicas and jittered heartbeats; clients
see the moves that matter. Lease writes go through the registry's own request inbox."""

import asyncio
import random
import time

import msgspec
import nats
import pytest

from reach import AgentEvent, Client, Registry, Status
from reach._codec import now_ms
from reach._registry.news import renew_after
from reach._wait import eventually

from .registry_wire import WireAgent, beat, fast_settings, heartbeat, stored


async def settled(registries: list[Registry], taken: int) -> None:
    """Until the replicas have taken ``taken`` heartbeats in all and written what they
    decided to (an event-less counter: polled, with a hang guard)."""

    def done() -> bool:
        seen = sum(r.stats.heartbeats for r in registries)
        busy = sum(r.footprint()["heartbeats_in_flight"] for r in registries)
        return seen >= taken and busy == 0

    await eventually(done, 10.0)


async def writes_so_far(js: nats.js.JetStreamContext, registry: Registry) -> int:
    """Messages written into the bucket (one agent in it: the revisions of its key)."""
    info = await js.stream_info(f"KV_{registry.bucket_name}")
    return int(info.state.last_seq)


async def test_a_steady_heartbeat_is_written_at_most_once_per_renewal_period(nats_server):
    settings = fast_settings(nats_server.url, heartbeat_interval=0.1, lease_ttl=1.2)
    period = renew_after(settings.lease_ttl, settings.heartbeat_interval)
    assert period == pytest.approx(0.35)
    nc = await nats.connect(nats_server.url)
    try:
        async with Registry(settings=settings) as registry:
            async with WireAgent(nc, settings, "steady-1"):
                js = nc.jetstream()
                registered = await writes_so_far(js, registry)
                started = time.monotonic()
                sent = 30
                for seq in range(1, sent + 1):
                    body = beat("steady-1", seq, load=0.25, latency_ms=12.0, sent_ms=now_ms())
                    await heartbeat(nc, settings, "steady-1", body)
                    await asyncio.sleep(settings.heartbeat_interval)  # the agent's pace
                await settled([registry], sent)
                elapsed = time.monotonic() - started
                written = await writes_so_far(js, registry) - registered
                # the first heartbeat is news (none stored yet), then renewals only
                assert 2 <= written <= 2 + elapsed / period, (written, elapsed)
                unwritten = registry.stats.heartbeats_unwritten
                assert unwritten > 0
                assert written + unwritten <= sent
                metrics = registry.telemetry.exposition().decode()
                assert f"reach_registry_heartbeats_unwritten_total {float(unwritten)}" in metrics
                record = await stored(nc, settings, "steady-1")
                assert record is not None
                assert record.status == Status.UP
    finally:
        await nc.close()


async def test_news_is_written_at_once_and_nothing_else(nats_server):
    # A lease far from renewal: whatever is written here is written for its news.
    settings = fast_settings(nats_server.url, heartbeat_interval=0.2, lease_ttl=60.0)
    nc = await nats.connect(nats_server.url)
    seq = 0
    try:
        async with Registry(settings=settings) as registry:

            async def send(**fields: object) -> int:
                """One heartbeat; the seq of the heartbeat the bucket holds after it."""
                nonlocal seq
                seq += 1
                fields.setdefault("load", 0.25)
                fields.setdefault("latency_ms", 10.0)
                body = beat("news-1", seq, sent_ms=now_ms(), **fields)
                await heartbeat(nc, settings, "news-1", body)
                await settled([registry], seq)
                record = await stored(nc, settings, "news-1")
                assert record is not None
                assert record.heartbeat is not None
                return record.heartbeat.seq

            async with WireAgent(nc, settings, "news-1"):
                assert await send() == 1  # the first heartbeat: nothing stored yet
                assert await send() == 1  # the same numbers: not written
                assert await send(load=0.3, latency_ms=12.0) == 1  # small moves
                assert await send(served=100, failed=3, inflight=2) == 1  # counters, not news
                assert await send(load=0.34) == 1  # drift, 0.09 from what is stored
                assert await send(load=0.36) == 6  # past 0.1 from what is stored
                assert await send(load=0.36, latency_ms=12.6) == 7  # 26% and 2.6 ms
                assert await send(load=0.36, latency_ms=12.6, queue_len=1) == 8
                assert await send(load=0.36, latency_ms=12.6, queue_len=1) == 8
                degraded = {"status": Status.DEGRADED, "reason": "slow"}
                assert await send(load=0.36, latency_ms=12.6, queue_len=1, **degraded) == 10
                degraded["reason"] = "slower"
                assert await send(load=0.36, latency_ms=12.6, queue_len=1, **degraded) == 11
                assert await send(load=0.36, latency_ms=12.6, queue_len=1, **degraded) == 11
                assert registry.stats.heartbeats_unwritten == 6
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("interval", "ttl", "lost_every"),
    [
        (1 / 3, 1.0, 0),  # the defaults' ratio (15 s / 5 s): every heartbeat renews
        (0.1, 1.2, 4),  # renewal every fourth heartbeat or so, and one in four lost
    ],
)
async def test_a_live_agent_never_goes_unknown(nats_server, interval, ttl, lost_every):
    """Jittered heartbeats (0.8 to 1.2 intervals apart), some lost, through two replicas
    in a queue group: the lease never expires, so no UNKNOWN is ever announced. (The
    server takes no lease under 1 s: ``Nats-TTL`` counts whole seconds at least.)"""
    settings = fast_settings(nats_server.url, heartbeat_interval=interval, lease_ttl=ttl)
    rng = random.Random(25)
    nc = await nats.connect(nats_server.url)
    events: list[AgentEvent] = []

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        events.append(msgspec.json.decode(msg.data, type=AgentEvent))

    await nc.subscribe(f"{settings.subject_prefix}.evt.agent.live-1", cb=on_event)
    try:
        async with (
            Registry(settings=settings) as r1,
            Registry(settings=settings) as r2,
            WireAgent(nc, settings, "live-1"),
        ):
            sent = 0
            for seq in range(1, round(4.0 / interval) + 1):
                if lost_every and seq % lost_every == 0:
                    pass  # lost on the way
                else:
                    body = beat("live-1", seq, load=0.5, sent_ms=now_ms())
                    await heartbeat(nc, settings, "live-1", body)
                    sent += 1
                await asyncio.sleep(interval * rng.uniform(0.8, 1.2))  # the agent's pace
            await settled([r1, r2], sent)
            await nc.flush()
            assert [e.new for e in events if e.new != Status.UP] == []
            assert [e.reason for e in events] == ["registered"]
            unwritten = r1.stats.heartbeats_unwritten + r2.stats.heartbeats_unwritten
            if renew_after(ttl, interval) > interval * 1.2:
                assert unwritten > sent / 3  # the rule did skip heartbeats
    finally:
        await nc.close()


async def test_clients_see_a_big_load_move_and_not_a_small_one(nats_server):
    settings = fast_settings(nats_server.url, heartbeat_interval=0.2, lease_ttl=60.0)
    nc = await nats.connect(nats_server.url)

    async def table_load(client: Client) -> float | None:
        for record in await client.agents():
            if record.info.agent_id == "moves-1" and record.heartbeat is not None:
                return record.heartbeat.load
        return None

    try:
        async with (
            Registry(settings=settings) as registry,
            Client(settings=settings) as client,
            WireAgent(nc, settings, "moves-1"),
        ):

            async def shows(load: float) -> bool:
                return await table_load(client) == load

            await heartbeat(nc, settings, "moves-1", beat("moves-1", 1, load=0.1))
            await eventually(lambda: shows(0.1), 10.0)
            await heartbeat(nc, settings, "moves-1", beat("moves-1", 2, load=0.15))
            await settled([registry], 2)
            assert registry.stats.heartbeats_unwritten == 1
            assert await table_load(client) == 0.1
            await heartbeat(nc, settings, "moves-1", beat("moves-1", 3, load=0.9))
            await eventually(lambda: shows(0.9), 10.0)
    finally:
        await nc.close()


async def test_lease_writes_go_through_one_request_inbox_per_connection(nats_server):
    settings = fast_settings(nats_server.url)
    nc = await nats.connect(nats_server.url)
    registry = Registry(settings=settings)
    try:
        await registry.start()
        api = registry._core.api
        assert api is not None
        assert api.nc is registry._core.nc
        async with WireAgent(nc, settings, "inbox-1"):
            assert api._inbox._seq >= 1  # the registration's write went through it
        await registry.stop()
        assert registry._core.api is None
        assert api._inbox.nc is None
        await registry.start()
        again = registry._core.api
        assert again is not None
        assert again is not api
        assert again.nc is registry._core.nc
    finally:
        await registry.stop()
        await nc.close()
