"""The embedded server helper, and agents and clients riding through a server restart."""

import asyncio
import os
import shutil
import signal
import subprocess
import time

import pytest

from reach import Agent, Client, ConnectionFailed, ReachError, ReachSettings, Registry, Status
from reach.testing import NatsServer, eventually, unique_prefix


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


async def known_up(client: Client, agent_id: str) -> bool:
    return any(r.info.agent_id == agent_id and r.status is Status.UP for r in await client.agents())


async def test_requests_while_the_server_is_away_fail_as_connection_lost(own_server):
    """They failed as timeouts, which opened every instance's breaker: after the outage
    requests got CircuitOpen naming the agents, not the lost connection (the
    server_restart chaos scenario reported 1129 circuit_open)."""
    settings = ReachSettings(
        nats_url=own_server.url, subject_prefix=unique_prefix(), heartbeat_interval=0.5
    )
    agent = Agent("survivor", "survivor-2", settings=settings)

    @agent.capability("still.here")
    async def here(req: dict) -> dict:
        return {"ok": req["n"]}

    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        # routed by the table: attempts go to the instance's own subject (its breaker)
        await eventually(lambda: known_up(client, "survivor-2"))
        assert await client.request("still.here", {"n": 1}) == {"ok": 1}
        await own_server.akill()
        await eventually(lambda: not client.connected)
        for n in range(8):  # more than opens a breaker
            with pytest.raises(ConnectionFailed, match="connection to NATS is down"):
                await client.request("still.here", {"n": n}, timeout=0.2)
        await own_server.astart()
        await eventually(lambda: client.connected and agent.client.connected, timeout=30)
        await agent.client.flush()
        assert await client.request("still.here", {"n": 2}) == {"ok": 2}


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


@pytest.fixture
def loop_guard(monkeypatch):
    """Blocking calls made on the event loop's thread raise instead of blocking it."""

    def guarded(original, what):
        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # another thread (asyncio.to_thread): blocking is fine
                return original(*args, **kwargs)
            raise AssertionError(f"{what} would block the event loop")

        return call

    monkeypatch.setattr(time, "sleep", guarded(time.sleep, "time.sleep"))
    monkeypatch.setattr(subprocess.Popen, "wait", guarded(subprocess.Popen.wait, "Popen.wait"))
    monkeypatch.setattr(shutil, "rmtree", guarded(shutil.rmtree, "shutil.rmtree"))


async def test_the_async_api_never_blocks_the_loop(loop_guard):
    server = NatsServer()
    await server.astart()
    pid = server.pid
    await server.arestart()
    assert server.pid != pid
    async with Client(server.url) as client:
        assert client.connected
    proc = server.proc
    await server.astop()
    assert proc.poll() is not None
    await server.astart()
    proc = server.proc
    await server.akill()
    assert proc.poll() is not None
    await server.astart()
    proc = server.proc
    await server.aclose()
    assert proc.poll() is not None
    assert not server.work_dir.exists()


async def test_concurrent_astart_runs_one_server(monkeypatch):
    started = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    server = NatsServer()

    async def url_once_started() -> str:
        await server.astart()
        return server.url

    try:
        # Both return once the one server is ready: neither spawns its own, neither returns
        # before the server can take clients.
        urls = await asyncio.gather(url_once_started(), url_once_started())
        assert started == [server.proc]
        assert urls == [server.url, server.url]
        assert server.url
    finally:
        await server.aclose()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def ignore_signals(monkeypatch) -> list[int]:
    """os.kill sends nothing: the server behaves like a process that will not die."""
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    return sent


async def test_astop_gives_up_with_a_clear_error_when_sigkill_does_not_end_it(
    own_server, monkeypatch
):
    sent = ignore_signals(monkeypatch)
    with pytest.raises(ReachError, match="after SIGKILL"):
        async with asyncio.timeout(10):  # without a bound it would poll forever
            await own_server.astop(timeout=0.05)
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    monkeypatch.undo()
    assert own_server.proc.poll() is None  # still there; the fixture stops it for real


async def test_stop_gives_up_with_a_clear_error_when_sigkill_does_not_end_it(
    own_server, monkeypatch
):
    proc = own_server.proc
    sent = ignore_signals(monkeypatch)
    try:
        with pytest.raises(ReachError, match="after SIGKILL"):
            async with asyncio.timeout(10):  # without a bound it would wait forever
                await asyncio.to_thread(own_server.stop, 0.05)
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        assert proc.poll() is None
    finally:
        monkeypatch.undo()
        proc.kill()  # for real now; frees the thread if stop() is still waiting
        await asyncio.to_thread(proc.wait)


async def test_async_context_manager_starts_and_stops():
    async with NatsServer(jetstream=False) as server:
        proc = server.proc
        async with Client(server.url) as client:
            assert client.connected
    assert proc.poll() is not None
