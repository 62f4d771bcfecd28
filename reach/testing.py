"""Test helpers for agents: a real nats-server on a random loopback port, and waiting for
a condition. None of it needs pytest.

The pytest fixtures are a plugin of their own (``reach._pytest_plugin``, entry point
``reach``), so in any project that depends on ``agent-reach-nats`` and has pytest, a test
can take ``reach_settings`` (or ``reach_nats_server``, ``reach_client``) and run agents
against a real server::

    async def test_translate(reach_settings):
        agent = Agent("translator", settings=reach_settings)
        ...

A test that needs a server of its own (to kill or restart it) uses the async side of
``NatsServer``, which never blocks the event loop::

    async with NatsServer() as server:
        ...
        await server.akill()
        await server.astart()  # same port and store

``NatsCluster(3)`` runs a JetStream cluster of three nodes on loopback the same way (sync or
async); its ``urls`` go into ``ReachSettings(nats_url=..., replicas=3)``, and
``akill_node(i)``/``astart_node(i)`` crash a node and bring it back on the same store.

``config_with_store(path, data_dir)`` gives a copy of a config (the shipped
``nats-server.conf``, say) whose JetStream store is in ``data_dir``, for
``NatsServer(config_file=...)``: tests and benches on the real durability settings.
"""

from __future__ import annotations

from nats.nuid import NUID

from ._cluster import NatsCluster
from ._server import NatsServer, config_with_store, nats_server_binary
from ._wait import eventually

__all__ = [
    "NatsCluster",
    "NatsServer",
    "config_with_store",
    "eventually",
    "nats_server_binary",
    "unique_prefix",
]


def unique_prefix() -> str:
    """A subject prefix no other test uses, so tests never see each other's traffic."""
    return "t" + NUID().next().decode().lower()
