"""How an agent looks for tasks while it has a backlog, on a real nats-server: a priority
level found empty is not probed again before every task of a lower level (each probe is a
round trip its free slots wait on), yet a task arriving there is still started before the
lower level's backlog, within a few of its tasks."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from reach import Agent, Client, ReachSettings
from reach._tasks import pull, runner
from reach.testing import eventually

CAP = "dispatch.op"


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_concurrency": 1})


def serve(agent: Agent, order: list[str], pause: float = 0.0) -> None:
    @agent.task(CAP)
    async def op(payload: dict[str, Any]) -> None:
        order.append(payload["p"])
        if pause:
            await asyncio.sleep(pause)  # a task's work, not a wait for another


async def test_an_empty_level_is_not_probed_before_every_task(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch
):
    """40 normal tasks, one slot: the high level, found empty, is probed again only after
    ``_EMPTY_FOR`` (an idle runner lingers on it instead)."""
    probes: dict[str, list[float]] = {}
    real = pull.Puller.probe

    async def probe(self: pull.Puller, n: int) -> Any:
        probes.setdefault(self.consumer.rsplit("-", 1)[1], []).append(
            asyncio.get_running_loop().time()
        )
        return await real(self, n)

    monkeypatch.setattr(pull.Puller, "probe", probe)
    order: list[str] = []
    agent = Agent("dispatch", settings=settings)
    serve(agent, order)
    async with Client(settings=settings) as client:
        batch = await client.submit_batch(CAP, [{"p": "normal"}] * 40)
        async with agent:
            assert all(r is None for r in await batch.results(timeout=60))
    assert len(order) == 40
    high = probes.get("high", [])
    gaps = [b - a for a, b in itertools.pairwise(high)]
    assert all(gap >= runner._EMPTY_FOR * 0.9 for gap in gaps), gaps


async def test_a_task_arriving_at_an_empty_level_still_goes_before_the_backlog(
    settings: ReachSettings,
):
    """A high task submitted while 40 normal ones wait behind one slot starts within the
    next few tasks, long before the normal backlog has drained."""
    order: list[str] = []
    agent = Agent("dispatch", settings=settings)
    serve(agent, order, pause=0.01)
    async with Client(settings=settings) as client:
        batch = await client.submit_batch(CAP, [{"p": "normal"}] * 40)
        async with agent:
            await eventually(lambda: len(order) >= 5, timeout=30)
            at = len(order)
            high = await client.submit(CAP, {"p": "high"}, priority="high")
            assert await high.result(timeout=30) is None
            assert all(r is None for r in await batch.results(timeout=60))
    assert order.index("high") <= at + 8, order
    assert order.count("normal") == 40
