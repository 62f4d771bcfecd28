"""Helpers shared by the durable-task tests: the task stream's name and emptiness, and an
agent that counts its runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import reach
from reach import Agent, Client, ReachSettings


def task_stream(settings: ReachSettings) -> str:
    return settings.subject_prefix.replace(".", "_").upper() + "_TASKS"


def stream_empty(client: Client, settings: ReachSettings) -> Callable[[], Awaitable[bool]]:
    """Whether the task stream is empty (a work queue: an acked message is gone)."""

    async def check() -> bool:
        info = await client.nc.jetstream().stream_info(task_stream(settings))
        return info.state.messages == 0

    return check


def counting_agent(settings: ReachSettings, name: str, cap: str, runs: list[str]) -> Agent:
    """Doubles ``n``; appends the task id to ``runs`` on every execution."""
    agent = Agent(name, settings=settings)

    @agent.task(cap)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(ctx.task_id)
        return {"n": payload["n"] * 2, "attempt": ctx.attempt}

    return agent
