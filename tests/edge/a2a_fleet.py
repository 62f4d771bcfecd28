"""A small fleet behind a real A2A endpoint, for the A2A tests: a registry, two agents, a
gateway client, and the A2A router served by uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskContext
from reach._gateway.a2a import ScopesOf, a2a_routes
from reach.testing import eventually


class EchoIn(msgspec.Struct):
    text: str
    n: int = 1


@dataclass
class Hold:
    """A task handler that waits until cancelled, and says when it started."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: list[str] = field(default_factory=list)
    #: text.count runs while this is set (a test clears it to look at a task mid-way)
    counting: asyncio.Event = field(default_factory=asyncio.Event)
    #: text.story yields its first word, then waits for this before the rest
    telling: asyncio.Event = field(default_factory=asyncio.Event)
    #: text.story calls that ended before their last word (cancelled by the caller)
    stories_cut: int = 0

    def __post_init__(self) -> None:
        self.counting.set()
        self.telling.set()


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a port of its own); the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", ws="none"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started or task.done(), timeout=30)
        if task.done():
            await task  # it failed to start: raise why
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def helper_agent(settings: ReachSettings, hold: Hold) -> Agent:
    agent = Agent(
        "helper",
        tags=["demo", "text"],
        version="2.1.0",
        drain_timeout=5,  # a test that fails leaves text.hold running: do not wait 30 s
        metadata={"description": "Text helpers for the A2A tests"},
        settings=settings,
    )

    @agent.capability("text.echo", version="1.2", description="Repeat the text n times")
    async def echo(p: EchoIn) -> dict[str, Any]:
        return {"echo": p.text * p.n}

    @agent.capability("text.story", description="Tell the text back a word at a time")
    async def story(p: dict[str, Any]) -> AsyncIterator[str]:
        words = p["text"].split() * int(p.get("times", 1))
        told = 0
        try:
            for i, word in enumerate(words):
                if i == 1:
                    await hold.telling.wait()
                if word == "boom":
                    raise RuntimeError("the storyteller fell silent")
                yield word
                told += 1
        finally:
            if told < len(words) and "boom" not in words:
                hold.stories_cut += 1

    @agent.capability("text.refuse")
    async def refuse(p: Any) -> None:
        raise reach.BadRequest("'text' is required")

    @agent.task("text.count", description="Count the words, as a durable task")
    async def count(p: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        await hold.counting.wait()
        await ctx.progress(0.5, "halfway")
        return {"words": len(p["text"].split())}

    @agent.task("text.hold", description="Wait until cancelled")
    async def wait(p: Any, ctx: TaskContext) -> None:
        hold.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            hold.cancelled.append(ctx.task_id)
            raise

    @agent.task("text.broken", max_attempts=1)
    async def broken(p: Any, ctx: TaskContext) -> None:
        raise RuntimeError("boom")

    return agent


def solo_agent(settings: ReachSettings) -> Agent:
    agent = Agent("solo", settings=settings)

    @agent.capability("solo.upper")
    async def upper(p: dict[str, Any]) -> str:
        return str(p["text"]).upper()

    return agent


@dataclass
class Fleet:
    url: str  # the gateway's base URL
    client: Client  # the gateway's Reach client
    hold: Hold


@asynccontextmanager
async def a2a_fleet(
    settings: ReachSettings, scopes_of: ScopesOf | None = None
) -> AsyncIterator[Fleet]:
    settings = settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})
    hold = Hold()
    app = FastAPI()
    async with (
        Registry(settings=settings),
        helper_agent(settings, hold),
        solo_agent(settings),
        Client(settings=settings, name="a2a-gateway") as client,
    ):
        app.include_router(a2a_routes(client, scopes_of=scopes_of))

        async def listed() -> bool:
            return {r.info.name for r in await client.agents()} == {"helper", "solo"}

        await eventually(listed, timeout=30)
        async with serving(app) as url:
            yield Fleet(url, client, hold)
