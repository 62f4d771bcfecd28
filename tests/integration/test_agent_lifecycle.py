"""One lifecycle for the agent: pause, resume, drain and stop, whoever asks and however started."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

import reach
from reach import Agent, Client, Registry, Status
from reach.testing import eventually, unique_prefix
from reach.wire import Control, ControlReply


@pytest.fixture
def settings(nats_server):
    return reach.ReachSettings(
        nats_url=nats_server.url,
        subject_prefix=unique_prefix(),
        heartbeat_interval=0.2,
        lease_ttl=1.0,
        probe_timeout=0.5,
        register_backoff=0.05,
        register_backoff_max=0.3,
    )


class Gate:
    """A handler that parks on ``hold`` until released, counting who served what."""

    def __init__(self) -> None:
        self.entered = 0
        self.release = asyncio.Event()
        self.served = 0


def gated(settings: reach.ReachSettings, agent_id: str, gate: Gate, **kw: Any) -> Agent:
    agent = Agent("life", agent_id, settings=settings, **kw)

    @agent.capability("life.op")
    async def op(req: dict[str, Any]) -> dict[str, Any]:
        if req.get("hold"):
            gate.entered += 1
            await gate.release.wait()
        if req.get("hang"):
            await asyncio.Event().wait()
        gate.served += 1
        return {"by": agent_id}

    return agent


async def control(client: Client, agent_id: str, command: str) -> ControlReply:
    msg = await client.nc.request(
        client.subjects.ctl(agent_id), msgspec.json.encode(Control(command=command)), timeout=5
    )
    return msgspec.json.decode(msg.data, type=ControlReply)


async def queue_call(client: Client) -> dict[str, Any]:
    reply: dict[str, Any] = await client.request("life.op", {}, max_attempts=1, timeout=5)
    return reply


async def takes_queue_work(client: Client) -> bool:
    try:
        await queue_call(client)
    except reach.CapabilityNotFound:
        return False
    return True


async def degrade_by_timeouts(client: Client, agent: Agent) -> None:
    """Three handler timeouts within the window make an agent DEGRADED."""
    for _ in range(3):
        with pytest.raises(reach.RequestTimeout):
            await client.request("life.op", {"hang": True}, agent_id=agent.agent_id, timeout=0.2)
    await eventually(lambda: agent.status == Status.DEGRADED)


@contextlib.asynccontextmanager
async def running(agent: Agent, mode: str, client: Client) -> AsyncIterator[asyncio.Task | None]:
    """Start ``agent`` the way ``mode`` says; yield the serve_forever task, if any."""
    if mode == "start":
        await agent.start()
        try:
            yield None
        finally:
            await agent.stop()
    elif mode == "async_with":
        async with agent:
            yield None
    else:
        task = asyncio.create_task(agent.serve_forever())
        await eventually(lambda: takes_queue_work(client))
        try:
            yield task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_pause_leaves_the_queue_group_and_resume_reenters_it(settings):
    gate = Gate()
    agent = gated(settings, "l-pause", gate)
    async with agent, Client(settings=settings, routing="queue") as client:
        assert (await control(client, "l-pause", "pause")).status == Status.PAUSED
        assert not await takes_queue_work(client)
        with pytest.raises(reach.AgentUnavailable, match="paused"):
            await client.request("life.op", {}, agent_id="l-pause", max_attempts=1)
        assert (await control(client, "l-pause", "resume")).status == Status.UP
        assert await queue_call(client) == {"by": "l-pause"}
        assert agent.state == "UP"
        # and again: each pause/resume leaves and re-enters exactly once
        await agent.pause()
        assert agent.state == "PAUSED"
        assert not await takes_queue_work(client)
        await agent.resume()
        assert await queue_call(client) == {"by": "l-pause"}


@pytest.mark.parametrize("mode", ["start", "async_with", "serve_forever"])
async def test_ctl_drain_finishes_in_flight_work_deregisters_and_stops(settings, mode):
    gate = Gate()
    agent = gated(settings, "l-drain", gate)
    async with (
        Registry(settings=settings) as registry,
        Client(settings=settings, routing="queue") as client,
        running(agent, mode, client) as task,
    ):
        await eventually(lambda: "l-drain" in registry.records())
        in_flight = asyncio.create_task(client.request("life.op", {"hold": True}, timeout=30))
        await eventually(lambda: gate.entered == 1)
        assert (await control(client, "l-drain", "drain")).status == Status.PAUSED
        assert agent.status == Status.PAUSED
        assert not await takes_queue_work(client)  # out of the queue group at once
        assert agent.state == "DRAINING"
        gate.release.set()
        assert await in_flight == {"by": "l-drain"}
        await eventually(lambda: agent.status == Status.DOWN)
        assert agent.state == "STOPPED"
        await eventually(lambda: "l-drain" not in registry.records())
        if task is not None:
            async with asyncio.timeout(10):
                await task  # serve_forever returns by itself after a drain


async def test_resume_during_stop_is_refused(settings):
    gate = Gate()
    agent = gated(settings, "l-stop", gate, drain_timeout=30)
    async with Client(settings=settings, routing="queue") as client:
        await agent.start()
        in_flight = asyncio.create_task(client.request("life.op", {"hold": True}, timeout=30))
        await eventually(lambda: gate.entered == 1)
        stopping = asyncio.create_task(agent.stop())
        await eventually(lambda: agent.status == Status.PAUSED)
        reply = await control(client, "l-stop", "resume")
        assert reply.status == Status.PAUSED
        assert not reply.ok
        assert agent.status == Status.PAUSED
        assert not await takes_queue_work(client)
        # direct subjects stay until the end and send callers elsewhere at once
        with pytest.raises(reach.AgentUnavailable, match="draining"):
            await client.request("life.op", {}, agent_id="l-stop", max_attempts=1)
        gate.release.set()
        assert await in_flight == {"by": "l-stop"}
        await stopping
    assert agent.status == Status.DOWN


async def test_resume_does_not_clear_degraded(settings):
    agent = gated(settings, "l-deg", Gate(), max_concurrency=4)
    async with agent, Client(settings=settings) as client:
        await degrade_by_timeouts(client, agent)
        await agent.pause()
        assert agent.status == Status.PAUSED
        await agent.resume()
        assert agent.status == Status.DEGRADED
        assert agent.state == "DEGRADED"
        with pytest.raises(reach.ResourceExhausted, match="DEGRADED"):
            await client.request("life.op", {}, agent_id="l-deg", priority="high", max_attempts=1)


async def test_drain_while_degraded_stops_the_agent(settings):
    agent = gated(settings, "l-dd", Gate(), max_concurrency=4)
    async with Client(settings=settings) as client:
        await agent.start()
        try:
            await degrade_by_timeouts(client, agent)
            assert (await control(client, "l-dd", "drain")).status == Status.PAUSED
            await eventually(lambda: agent.status == Status.DOWN)
        finally:
            await agent.stop()
    assert agent.state == "STOPPED"


async def test_stop_during_drain_waits_for_the_same_drain(settings):
    gate = Gate()
    agent = gated(settings, "l-sd", gate, drain_timeout=30)
    async with Client(settings=settings) as client:
        await agent.start()
        in_flight = asyncio.create_task(client.request("life.op", {"hold": True}, timeout=30))
        await eventually(lambda: gate.entered == 1)
        await control(client, "l-sd", "drain")
        stopping = [asyncio.create_task(agent.stop()) for _ in range(2)]
        await eventually(lambda: agent.status == Status.PAUSED)
        assert not any(t.done() for t in stopping)
        assert agent.state == "DRAINING"
        gate.release.set()
        await asyncio.gather(*stopping)
        assert await in_flight == {"by": "l-sd"}
    assert agent.state == "STOPPED"
    assert gate.served == 1


async def test_an_agent_starts_again_after_a_drain(settings):
    agent = gated(settings, "l-again", Gate())
    async with Client(settings=settings, routing="queue") as client:
        await agent.start()
        await control(client, "l-again", "drain")
        await eventually(lambda: agent.status == Status.DOWN)
        assert agent.state == "STOPPED"
        await agent.start()
        try:
            assert agent.state == "UP"
            assert await queue_call(client) == {"by": "l-again"}
        finally:
            await agent.stop()


async def test_pausing_under_load_loses_no_queue_request(settings):
    """Leaving a queue group while requests stream in: each is answered by someone.
    (nats-py's own drain could drop a request routed in its flush window.)"""
    first, second = gated(settings, "l-busy-1", Gate()), gated(settings, "l-busy-2", Gate())
    async with first, second, Client(settings=settings, routing="queue") as client:
        stop = asyncio.Event()
        failures: list[BaseException] = []
        served = 0

        async def stream() -> None:
            nonlocal served
            while not stop.is_set():
                try:
                    await client.request("life.op", {}, max_attempts=1, timeout=2)
                    served += 1
                except reach.ReachError as exc:
                    failures.append(exc)

        streams = [asyncio.create_task(stream()) for _ in range(32)]
        for _ in range(30):
            before = served
            await eventually(lambda before=before: served >= before + 50)
            await first.pause()
            await eventually(lambda before=before: served >= before + 100)
            await first.resume()
        stop.set()
        await asyncio.gather(*streams)
    assert failures == []


async def test_a_failure_while_closing_still_stops_the_agent(settings, monkeypatch):
    agent = gated(settings, "l-close-fails", Gate())
    await agent.start()
    nc = agent.client.nc

    async def broken_close() -> None:
        raise RuntimeError("close failed")

    monkeypatch.setattr(agent.client, "close", broken_close)
    with pytest.raises(RuntimeError, match="close failed"):
        await agent.stop()
    assert agent.status == Status.DOWN
    monkeypatch.undo()
    await nc.close()
    await agent.start()  # not stuck in DRAINING: it starts again
    await agent.stop()


async def test_stop_during_starting_stops_the_agent(settings):
    agent = gated(settings, "l-stop-starting", Gate())
    starting = asyncio.create_task(agent.start())
    await eventually(lambda: agent.status == Status.PAUSED)  # STARTING shows as PAUSED
    await agent.stop()
    await starting
    assert agent.status == Status.DOWN
    async with Client(settings=settings, routing="queue") as client:
        assert not await takes_queue_work(client)


async def test_concurrent_starts_after_a_failed_one_do_not_claim_success(nats_server):
    settings = reach.ReachSettings(
        nats_url="nats://127.0.0.1:1", subject_prefix=unique_prefix(), connect_timeout=0.5
    )
    agent = gated(settings, "l-start-fails", Gate())
    results = await asyncio.gather(agent.start(), agent.start(), return_exceptions=True)
    assert all(isinstance(r, reach.ReachError) for r in results), results
    assert agent.status == Status.DOWN


async def test_a_resume_in_flight_when_a_drain_starts_does_not_bring_the_agent_back(settings):
    agent = gated(settings, "l-resume-drain", Gate())
    await agent.start()
    await agent.pause()
    resuming = asyncio.create_task(agent.resume())
    drained = asyncio.create_task(agent.wait_drain_requested())
    agent.request_drain()  # before the resume finishes joining the queue groups
    await resuming
    assert agent.status != Status.UP
    await drained
    await agent.stop()
    assert agent.status == Status.DOWN


async def test_a_stopped_agent_is_gone_at_once_for_direct_callers(settings):
    """Once stop() returns the server has dropped the agent's interest: a direct caller
    gets no-responders at once, never a timeout against a dead subscription."""
    for i in range(20):
        # a client each time: its capability breaker would open after a few refusals
        async with Client(settings=settings) as client:
            agent = gated(settings, f"l-gone-{i}", Gate())
            async with agent:
                assert await client.request("life.op", {}, agent_id=agent.agent_id) == {
                    "by": agent.agent_id
                }
            with pytest.raises(reach.AgentUnavailable):
                await client.request("life.op", {}, agent_id=agent.agent_id, timeout=2)
