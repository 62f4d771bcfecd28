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


def fail_write_once(
    monkeypatch: Any, agent: Agent, state: reach.TaskState, *, stored: bool
) -> list[Any]:
    """Make the agent's next record write of ``state`` fail as a JetStream publish with no
    answer does (``nats.errors.TimeoutError``): not stored, or stored with its answer lost.
    Fault injection in our own store, not a mock of NATS. The records it failed, listed."""
    import nats.errors

    from reach._tasks.store import TaskStore

    store = agent._tasks.store
    assert isinstance(store, TaskStore)
    real = store.write
    failed: list[Any] = []

    async def write(record: Any, last: int) -> int:
        if record.state is state and not failed:
            failed.append(record)
            if stored:
                await real(record, last)
            raise nats.errors.TimeoutError
        return await real(record, last)

    monkeypatch.setattr(store, "write", write)
    return failed
