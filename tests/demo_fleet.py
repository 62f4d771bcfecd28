"""The demo's fleet (``reach demo``: intent, aftersales, logistics), in this process, for
the tests of what is generated from a live fleet (AsyncAPI, MCP)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from reach import Agent, Client, ReachSettings, Registry
from reach.examples import aftersales, intent, logistics
from reach.testing import eventually

#: what the demo fleet serves by request, as durable tasks, and hears
CAPABILITIES = ["aftersales.refund", "logistics.track", "support.ask"]
TASKS = ["logistics.reroute"]
TOPICS = ["order.*"]


async def _quiet(update: dict[str, Any], topic: str) -> None:
    return None


def demo_agents(settings: ReachSettings) -> list[Agent]:
    return [
        intent.build(settings),
        aftersales.build(settings, on_status=_quiet),
        logistics.build(settings),
    ]


async def listed(client: Client, *agents: Agent) -> None:
    """Wait until ``client``'s routing table holds every one of ``agents``."""

    async def all_there() -> bool:
        ids = {r.info.agent_id for r in await client.agents()}
        return all(a.agent_id in ids for a in agents)

    await eventually(all_there, timeout=30)


@contextlib.asynccontextmanager
async def demo_fleet(settings: ReachSettings) -> AsyncIterator[list[Agent]]:
    """A registry and the demo's agents, running and in the routing table."""
    agents = demo_agents(settings)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(Registry(settings=settings))
        for agent in agents:
            await stack.enter_async_context(agent)
        client = await stack.enter_async_context(Client(settings=settings))
        await listed(client, *agents)
        yield agents
