"""The wrapper's health check and drain: a failing service makes the agent DEGRADED, then
PAUSED, and its recovery brings the agent back; a drain finishes what is in flight."""

import asyncio

import msgspec
import pytest

import reach
from reach import Client, Priority, Registry, Status
from reach._agent import State
from reach._wrap import HttpWrapper
from reach.testing import eventually
from reach.wire import Control, ControlReply
from tests.integration.registry_wire import fast_settings

from .wrap_upstream import free_port, serve_upstream, spec


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url, down_grace=30.0)


@pytest.fixture
async def upstream():
    async with serve_upstream() as up:
        yield up


def wrapped(upstream, settings, *, interval=3600.0, pause_after=2, health_url=None):
    return HttpWrapper(
        spec(
            {"capability": "h.ask", "url": upstream.url("/echo")},
            agent_id="h-1",
            health={
                "url": health_url or upstream.url("/health"),
                "interval": interval,
                "timeout": 2,
                "pause_after": pause_after,
            },
        ),
        settings=settings,
    )


async def takes_queue_work(client: Client) -> bool:
    try:
        await client.request("h.ask", {}, timeout=5, max_attempts=1)
    except reach.CapabilityNotFound:
        return False
    return True


async def takes_queue_work_not(client: Client) -> bool:
    return not await takes_queue_work(client)


async def test_failing_health_degrades_then_pauses_and_recovery_resumes(settings, upstream):
    w = wrapped(upstream, settings)  # probes at start, then only when the test says
    async with (
        Registry(settings=settings) as registry,
        w,
        Client(settings=settings, routing="queue") as client,
    ):
        assert w.health is not None
        await eventually(lambda: w.health.probes == 1)
        assert w.agent.state is State.UP

        upstream.healthy = False
        assert not await w.health.check_once()
        assert w.agent.state is State.DEGRADED
        assert w.health.last_error == "HTTP 503"
        await eventually(lambda: registry.records()["h-1"].status is Status.DEGRADED)
        # DEGRADED: normal work still comes, high priority is sent elsewhere.
        assert await client.request("h.ask", {"n": 1}, timeout=5) == {"got": {"n": 1}}
        with pytest.raises(reach.ResourceExhausted, match="DEGRADED"):
            await client.request("h.ask", {}, priority=Priority.HIGH, timeout=5, max_attempts=1)

        assert not await w.health.check_once()  # the second failure in a row
        assert w.agent.state is State.PAUSED
        await eventually(lambda: registry.records()["h-1"].status is Status.PAUSED)
        assert not await takes_queue_work(client)

        upstream.healthy = True
        assert await w.health.check_once()
        assert w.agent.state is State.UP
        await eventually(lambda: registry.records()["h-1"].status is Status.UP)
        assert await takes_queue_work(client)


async def test_the_probe_loop_pauses_on_an_unreachable_service_and_resumes(settings, upstream):
    w = wrapped(upstream, settings, interval=0.05, pause_after=3)
    async with w, Client(settings=settings, routing="queue") as client:
        assert w.health is not None
        await eventually(lambda: w.health.probes >= 1)
        upstream.healthy = False
        await eventually(lambda: w.agent.state is State.PAUSED)
        assert w.health.failures >= 3
        upstream.healthy = True
        await eventually(lambda: w.agent.state is State.UP)
        assert w.health.failures == 0
        assert await takes_queue_work(client)

    unreachable = wrapped(
        upstream, settings, interval=0.05, health_url=f"http://127.0.0.1:{free_port()}/"
    )
    async with unreachable:
        await eventually(lambda: unreachable.agent.state is State.PAUSED)
        assert unreachable.health is not None
        assert unreachable.health.last_error.startswith("ConnectError")


async def test_a_pause_by_an_operator_outlives_the_health_recovery(settings, upstream):
    w = wrapped(upstream, settings, pause_after=1)
    async with w:
        assert w.health is not None
        await eventually(lambda: w.health.probes == 1)
        await w.agent.pause()  # as `reach pause` does
        upstream.healthy = False
        assert not await w.health.check_once()
        upstream.healthy = True
        assert await w.health.check_once()
        assert w.agent.state is State.PAUSED  # not the health check's pause to undo


async def test_health_pause_then_operator_pause_survives_the_recovery(settings, upstream):
    w = wrapped(upstream, settings, pause_after=1)
    async with w:
        assert w.health is not None
        await eventually(lambda: w.health.probes == 1)
        upstream.healthy = False
        assert not await w.health.check_once()
        assert w.agent.state is State.PAUSED  # the health check's pause
        await w.agent.resume()  # an operator's resume during the outage...
        assert w.agent.state is State.PAUSED  # ...does not undo it
        await w.agent.pause()  # then the operator pauses it too
        upstream.healthy = True
        assert await w.health.check_once()
        assert w.agent.state is State.PAUSED  # the operator's pause stays
        await w.agent.resume()
        assert w.agent.state is State.UP


async def test_operator_resume_during_an_outage_then_health_still_pauses(settings, upstream):
    w = wrapped(upstream, settings, pause_after=2)
    async with w:
        assert w.health is not None
        await eventually(lambda: w.health.probes == 1)
        upstream.healthy = False
        assert not await w.health.check_once()
        assert not await w.health.check_once()
        assert w.agent.state is State.PAUSED
        await w.agent.resume()
        assert w.agent.state is State.PAUSED
        # Failures past pause_after keep it paused, and recovery still resumes it.
        assert not await w.health.check_once()
        assert w.agent.state is State.PAUSED
        upstream.healthy = True
        assert await w.health.check_once()
        assert w.agent.state is State.UP


async def test_a_resume_that_fails_is_tried_again_at_the_next_probe(settings, upstream):
    w = wrapped(upstream, settings, pause_after=1)
    async with w:
        assert w.health is not None
        await eventually(lambda: w.health.probes == 1)
        upstream.healthy = False
        assert not await w.health.check_once()
        assert w.agent.state is State.PAUSED
        subs = w.agent._subs
        join = subs.join_queues
        failures = []

        async def join_fails_once(*args, **kw):
            if not failures:
                failures.append(1)
                raise ConnectionError("injected: the join failed")
            return await join(*args, **kw)

        subs.join_queues = join_fails_once
        upstream.healthy = True
        with pytest.raises(ConnectionError, match="injected"):
            await w.health.check_once()
        assert w.agent.state is State.PAUSED
        assert await w.health.check_once()
        assert w.agent.state is State.UP


async def control(client: Client, agent_id: str, command: str) -> ControlReply:
    """What `reach drain <agent_id>` sends."""
    msg = await client.nc.request(
        client.subjects.ctl(agent_id), msgspec.json.encode(Control(command=command)), timeout=5
    )
    return msgspec.json.decode(msg.data, type=ControlReply)


async def test_drain_finishes_in_flight_requests_then_stops_and_closes_the_pool(settings, upstream):
    w = HttpWrapper(
        spec(
            {"capability": "h.hold", "url": upstream.url("/hold"), "timeout": 30},
            {"capability": "h.ask", "url": upstream.url("/echo")},
            agent_id="h-drain",
        ),
        settings=settings,
    )
    async with (
        Registry(settings=settings) as registry,
        Client(settings=settings, routing="queue") as client,
    ):
        serving = asyncio.create_task(w.serve_forever())
        try:
            await eventually(lambda: "h-drain" in registry.records())
            pool = w.http
            in_flight = asyncio.create_task(client.request("h.hold", {}, timeout=30))
            await eventually(lambda: upstream.held == 1)

            assert (await control(client, "h-drain", "drain")).status is Status.PAUSED
            # Out of the queue groups (requests routed there before that are still served).
            await eventually(lambda: takes_queue_work_not(client))
            assert w.agent.state is State.DRAINING  # the held request is still running

            upstream.release.set()
            assert await in_flight == {"held": True}
            async with asyncio.timeout(10):
                await serving  # serve_forever returns by itself after a drain
        finally:
            serving.cancel()
        assert w.agent.state is State.STOPPED
        await eventually(lambda: "h-drain" not in registry.records())
        assert pool.is_closed
        with pytest.raises(reach.NotStarted):
            _ = w.http


async def test_the_first_probe_comes_before_the_agent_is_up(settings, upstream):
    upstream.healthy = False
    async with wrapped(upstream, settings, pause_after=3) as w:
        assert w.health is not None
        assert (w.health.probes, w.agent.state) == (1, State.DEGRADED)  # no UP in between
    async with wrapped(upstream, settings, pause_after=1) as w:
        assert w.agent.state is State.PAUSED
    upstream.healthy = True
    async with wrapped(upstream, settings) as w:
        assert w.agent.state is State.UP


async def test_a_drain_under_async_with_stops_the_probes_and_closes_the_pool(settings, upstream):
    async with (
        Client(settings=settings) as client,
        wrapped(upstream, settings, interval=0.05) as w,
    ):
        pool = w.http
        await eventually(lambda: w.health is not None and w.health.probes >= 2)
        await control(client, "h-1", "drain")
        await eventually(lambda: w.agent.state is State.STOPPED)
        await eventually(lambda: pool.is_closed)
        # the probe loop and the follower end with the agent (the follower just after it
        # closed the pool: a turn of the loop later)
        await eventually(lambda: len(w._owner) == 0)
        with pytest.raises(reach.NotStarted):
            _ = w.http
    assert pool.is_closed
