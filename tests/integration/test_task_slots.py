"""What an agent's task slots bound, on a real nats-server: handlers, never more than the
slots; a task whose handler has returned gives its slot to the next while its end is
recorded and acked (at most as many of those as slots). And a claim taken beside the first
read of a task's record is given back when the record says the task has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from reach import Agent, Client, ReachSettings, TaskState
from reach._tasks.refs import cancel_record
from reach._tasks.store import TaskStore, idem_key
from reach.testing import eventually

from .task_helpers import stream_empty

S = TaskState
CAP = "slots.op"


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_concurrency": 1, "task_ack_wait": 5.0})


class Handlers:
    """A handler that counts its runs and how many ran at once."""

    def __init__(self) -> None:
        self.runs: list[int] = []
        self.now = 0
        self.most = 0

    def serve(self, agent: Agent) -> None:
        @agent.task(CAP)
        async def op(payload: dict[str, Any]) -> dict[str, Any]:
            self.now += 1
            self.most = max(self.most, self.now)
            self.runs.append(payload["n"])
            await asyncio.sleep(0)  # a turn of the loop: another handler could start here
            self.now -= 1
            return {"n": payload["n"]}


def hold_ends(agent: Agent) -> tuple[asyncio.Event, list[str]]:
    """Hold every SUCCEEDED record write of the agent until the event is set: its end is
    being recorded for as long as a slow fsync would take. Fault injection in our own
    store, not a mock of NATS. The tasks whose end is held, listed."""
    store = agent._tasks.store
    assert isinstance(store, TaskStore)
    real = store.write
    release = asyncio.Event()
    held: list[str] = []

    async def write(record: Any, last: int) -> int:
        if record.state is S.SUCCEEDED:
            held.append(record.task_id)
            await release.wait()
        return await real(record, last)

    store.write = write  # type: ignore[method-assign]
    return release, held


async def test_a_slot_is_free_once_its_handler_returned(settings: ReachSettings):
    """One slot: the second task runs while the first one's end is still being written,
    and the two handlers never run at once."""
    handlers = Handlers()
    agent = Agent("slots", settings=settings)
    handlers.serve(agent)
    async with agent, Client(settings=settings) as client:
        release, held = hold_ends(agent)
        first = await client.submit(CAP, {"n": 1})
        await eventually(lambda: held == [first.task_id], timeout=30)
        second = await client.submit(CAP, {"n": 2})
        await eventually(lambda: handlers.runs == [1, 2], timeout=30)
        release.set()
        assert await first.result(timeout=30) == {"n": 1}
        assert await second.result(timeout=30) == {"n": 2}
        await eventually(stream_empty(client, settings), timeout=30)
    assert handlers.most == 1
    assert agent.task_stats.succeeded == 2


async def test_tasks_being_recorded_never_outnumber_the_slots(settings: ReachSettings):
    """One slot, every end held: one task is recorded while the next runs, and no third
    starts until an end is written; then all three end, each run once."""
    handlers = Handlers()
    agent = Agent("slots", settings=settings)
    handlers.serve(agent)
    async with agent, Client(settings=settings) as client:
        release, held = hold_ends(agent)
        refs = [await client.submit(CAP, {"n": n}) for n in (1, 2, 3)]
        await eventually(lambda: len(held) == 2, timeout=30)
        # both held ends take the one slot and the one place for an end being recorded
        assert agent.task_stats.running == 2
        assert len(handlers.runs) == 2
        release.set()
        for n, ref in enumerate(refs, 1):
            assert await ref.result(timeout=30) == {"n": n}
        await eventually(stream_empty(client, settings), timeout=30)
    assert sorted(handlers.runs) == [1, 2, 3]
    assert handlers.most == 1


async def test_a_claim_taken_beside_the_record_read_is_released_when_the_task_has_ended(
    settings: ReachSettings,
):
    """A task with a key whose first delivery finds it CANCELLED (a cancel cut short
    before it removed the message): nothing runs, the message goes, and the key's run
    claim, taken while the record was read, is not left to lapse."""
    handlers = Handlers()
    agent = Agent("slots", settings=settings)
    handlers.serve(agent)
    async with Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1}, idempotency_key="slots-key")
        store = client._tasks.store
        await cancel_record(store, ref.task_id)  # the record only, as a cancel cut short
        assert not await stream_empty(client, settings)()
        async with agent:
            await eventually(stream_empty(client, settings), timeout=30)
            await eventually(lambda: agent.task_stats.running == 0, timeout=30)
        assert await store.idem_get(idem_key("run", "slots-key")) is None
        rec = await ref.status()
    assert rec.state is S.CANCELLED
    assert [s.state for s in rec.history] == [S.PENDING, S.CANCELLED]
    assert handlers.runs == []
    assert agent.task_stats.duplicates == 1
