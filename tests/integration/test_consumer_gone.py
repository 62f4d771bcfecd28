"""A durable consumer deleted under a running agent (an operator; a durable topic's
inactive threshold after a long pause): the agent's puller says so once, backs off instead
of asking again at once, makes the consumer again and goes on pulling. Specified once,
run for both users of the puller: a durable topic subscription and a task capability."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.js.errors
import pytest

from reach import Agent, Client, ReachSettings
from reach._tasks.pull import Puller
from reach.testing import eventually
from reach.wire import Priority


@dataclass
class Case:
    """One user of the puller: its agent, how to make it handle one item, and its puller."""

    agent: Agent
    stream: str
    consumer: Callable[[], str]
    puller: Callable[[], Puller]
    handle: Callable[[Client, int], Awaitable[None]]


def topic_case(settings: ReachSettings) -> Case:
    got: list[int] = []
    agent = Agent("sink", settings=settings)

    @agent.on_topic("orders", durable=True)
    async def on_order(n: int) -> None:
        got.append(n)

    async def handle(client: Client, n: int) -> None:
        await client.publish("orders", n, durable=True)
        await eventually(lambda: n in got, timeout=30)

    def sub() -> object:
        return agent._durable_topics._subs[0]

    return Case(
        agent,
        f"{settings.subject_prefix.upper()}_TOPICS",
        lambda: sub().consumer,  # type: ignore[attr-defined]
        lambda: sub().puller,  # type: ignore[attr-defined]
        handle,
    )


def task_case(settings: ReachSettings) -> Case:
    agent = Agent("worker", settings=settings)

    @agent.task("gone.op")
    async def op(n: int) -> int:
        return n

    async def handle(client: Client, n: int) -> None:
        ref = await client.submit("gone.op", n)
        assert await ref.result(timeout=30) == n

    def puller() -> Puller:
        return agent._tasks._pullers[("gone.op", Priority.NORMAL)]

    return Case(
        agent,
        f"{settings.subject_prefix.upper()}_TASKS",
        lambda: puller().consumer,
        puller,
        handle,
    )


@pytest.mark.parametrize("make", [topic_case, task_case], ids=["topic", "task"])
async def test_a_deleted_consumer_is_made_again_without_spinning(
    reach_settings: ReachSettings,
    make: Callable[[ReachSettings], Case],
    caplog: pytest.LogCaptureFixture,
) -> None:
    case = make(reach_settings)
    async with case.agent, Client(settings=reach_settings) as client:
        await case.handle(client, 1)
        js = client.nc.jetstream()
        name = case.consumer()
        puller = case.puller()
        before = puller.statuses
        caplog.set_level(logging.INFO, logger="reach")
        await js.delete_consumer(case.stream, name)

        async def exists() -> bool:
            try:
                await js.consumer_info(case.stream, name)
            except nats.js.errors.NotFoundError:
                return False
            return True

        # the old code asked for the gone consumer's messages again at once, for ever
        # (17,291 pull requests in 2 s), and never made it again: deaf
        await eventually(exists, timeout=30)
        await case.handle(client, 2)
        assert case.puller() is puller
        assert puller.statuses - before < 10
        gone = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and name in r.getMessage() and "gone" in r.getMessage()
        ]
        assert len(gone) == 1, [r.getMessage() for r in caplog.records]
        assert any(
            "made again" in r.getMessage() and name in r.getMessage() for r in caplog.records
        )
