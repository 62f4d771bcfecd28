"""The embedded server helper, and agents and clients riding through a server restart."""

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
        own_server.kill()
        await eventually(lambda: not client.connected and not agent.client.connected)
        own_server.start()
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
