"""A small fleet for the status page's tests: a registry, two echo agents, a task agent,
a client that sees them all, and a status feed on that client."""

import contextlib

from fastapi import FastAPI

from reach import Agent, Client, HandlerFailed, Registry
from reach._gateway.page import StatusFeed, page_routes
from reach.testing import eventually

ECHO, TASK = "text.echo", "report.build"


def echo_agent(settings, agent_id):
    agent = Agent("echo", agent_id, settings=settings)

    @agent.capability(ECHO, description="says it back")
    async def echo(req: dict) -> dict:
        if req.get("fail"):
            raise ValueError("asked to fail")
        return req

    return agent


def task_agent(settings):
    agent = Agent("builder", "builder-1", settings=settings)

    @agent.task(TASK)
    async def build(payload: dict) -> dict:
        if payload.get("fail"):
            raise ValueError("the report's month does not exist")
        return {"n": payload["n"] * 2}

    return agent


class Fleet:
    def __init__(self, client, agents, feed):
        self.client, self.agents, self.feed = client, agents, feed

    def app(self, **options):
        app = FastAPI()
        app.include_router(page_routes(self.client, feed=self.feed, **options))
        return app

    async def statuses(self):
        return {r.info.agent_id: r.status.value for r in await self.client.agents()}

    async def traffic(self, ok, failing):
        for i in range(failing):
            with contextlib.suppress(HandlerFailed):
                await self.client.request(ECHO, {"fail": True, "i": i})
        for i in range(ok):
            assert await self.client.request(ECHO, {"i": i}) == {"i": i}


@contextlib.asynccontextmanager
async def fleet(settings, **feed_options):
    """The fleet, every agent UP and seen by the client; the feed started."""
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(Registry(settings=settings))
        agents = {
            "echo-1": echo_agent(settings, "echo-1"),
            "echo-2": echo_agent(settings, "echo-2"),
            "builder-1": task_agent(settings),
        }
        for agent in agents.values():
            await stack.enter_async_context(agent)
        client = await stack.enter_async_context(Client(settings=settings, name="page-test"))
        feed = StatusFeed(client, **feed_options)
        await feed.start()
        stack.push_async_callback(feed.close)
        out = Fleet(client, agents, feed)

        async def all_up():
            return await out.statuses() == dict.fromkeys(agents, "UP")

        await eventually(all_up)
        yield out
