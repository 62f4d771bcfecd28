"""The embedded server helper, and agents and clients riding through a server restart."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from reach import Agent, Client, ReachSettings
from reach.testing import NatsServer, eventually


@pytest.fixture
def own_server():
    server = NatsServer().start()
    yield server
    server.close()


async def test_agents_and_clients_ride_through_a_server_restart(own_server):
    settings = ReachSettings(nats_url=own_server.url)
    agent = Agent("survivor", "survivor-1", settings=settings)

    @agent.capability("still.here")
    async def here(req: dict) -> dict:
        return {"ok": req["n"]}

    async with agent, Client(settings=settings) as client:
        assert await client.request("still.here", {"n": 1}) == {"ok": 1}
        port, store, pid = own_server.port, own_server.store_dir, own_server.pid
        await own_server.akill()
        await eventually(lambda: not client.connected and not agent.client.connected)
        await own_server.astart()
        assert (own_server.port, own_server.store_dir) == (port, store)
        assert own_server.pid != pid
        await eventually(lambda: client.connected and agent.client.connected, timeout=30)
        await agent.client.flush()  # its resubscriptions have reached the server
        assert await client.request("still.here", {"n": 2}) == {"ok": 2}
        assert await client.request("still.here", {"n": 3}, agent_id="survivor-1") == {"ok": 3}


def test_stop_is_by_pid_and_idempotent(own_server):
    proc = own_server.proc
    own_server.stop()
    assert proc.poll() is not None
    own_server.stop()
    own_server.kill()
    own_server.restart()
    assert own_server.proc.poll() is None


async def test_async_stop_kill_and_restart_are_by_pid_and_idempotent(own_server):
    proc = own_server.proc
    await own_server.astop()
    assert proc.poll() is not None
    await own_server.astop()
    await own_server.akill()
    await own_server.arestart()
    assert own_server.proc.poll() is None
    await own_server.akill()
    assert own_server.proc.poll() is not None


async def ticks_during(call: Callable[[], Awaitable[object]]) -> int:
    """How often another task got the loop while ``call()`` ran (0: the call blocked it)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is running
    before = ticks
    try:
        await call()
        return ticks - before
    finally:
        task.cancel()


async def test_async_start_and_restart_leave_the_loop_free():
    server = NatsServer()
    try:
        assert await ticks_during(server.astart) > 0
        assert server.proc.poll() is None
        pid = server.pid
        assert await ticks_during(server.arestart) > 0
        assert server.pid != pid
        assert server.proc.poll() is None
        async with Client(server.url) as client:
            assert client.connected
    finally:
        await server.aclose()
    assert server.proc.poll() is not None


async def test_async_context_manager_starts_and_stops():
    async with NatsServer(jetstream=False) as server:
        proc = server.proc
        async with Client(server.url) as client:
            assert client.connected
    assert proc.poll() is not None
