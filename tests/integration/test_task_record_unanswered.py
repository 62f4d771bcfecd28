"""A run whose end cannot be recorded at once (the records bucket between leaders: the
write gets no responders) keeps its result: the agent holds the message and writes the
record again until it lands, instead of dropping the result and letting the message come
back after ack_wait to run the task a second time (cluster_failover counted hundreds of
such runs when the records' leader was killed)."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest

import reach
from reach import Agent, Client, ReachSettings, TaskState
from reach._tasks.store import TaskStore

CAP = "jobs.once"


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 1.0})


async def test_a_record_write_with_no_responders_is_tried_again_not_run_again(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch
):
    runs: list[int] = []
    agent = Agent("once", settings=settings)

    @agent.task(CAP)
    async def job(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(ctx.attempt)
        return {"ok": True}

    write = TaskStore.write
    refused: list[str] = []

    async def unanswered(self: TaskStore, record: Any, last: int) -> int:
        # the final record of the first run: unanswered for about 2.5 x ack_wait
        if record.state is TaskState.SUCCEEDED and len(refused) < 5:
            refused.append(record.task_id)
            await asyncio.sleep(0.5)
            raise nats.errors.NoRespondersError
        return await write(self, record, last)

    monkeypatch.setattr(TaskStore, "write", unanswered)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1})
        rec = await ref.wait(timeout=20)
        assert rec.state is TaskState.SUCCEEDED
        assert len(refused) == 5
    assert runs == [1], f"the task ran {len(runs)} times"
